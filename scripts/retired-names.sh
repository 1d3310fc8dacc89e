#!/usr/bin/env bash
# Fails when the code or the docs use a name the redesign retired (one name per concept; see docs/concepts.md,
# "Where the code lives"). Each line: a pattern, then what replaced it.
set -euo pipefail
cd "$(dirname "$0")/.."
retired=(
  'crate::pipeline::|the step pipeline is crate::step'
  'pipeline/staged|the pipelined step is pipeline_parallel/runtime.rs'
  'distributed::stages|pipeline parallelism lives in pipeline_parallel (distributed::stages is a deprecated alias)'
  '\.stages\(\)|no strategy answers with its pipeline: the facade holds its stage (Accelerator::stage)'
  'pipeline_stage\(|the facade holds its stage (Accelerator::stage)'
  'for_group\(|strategies are built for the mesh (strategy::for_data_parallel, parallelize)'
  'PipelineLayout::of|the layout comes from the mesh (Accelerator::pipeline_layout, distributed::mesh)'
  'checkpoint::fs|durable files are crate::fs'
  'memory::release_free_heap|memory::release_after_freeing|the heap is crate::heap'
  'logging::warn_visibly|warnings without a logger are crate::notice'
  'on_device::host_free|on_device::check_against_reference|the trainings that check the transport are crate::diagnostics'
  'SplitKind|strategy::Split\b|fn splits\(|the slices of a parameter over its shard group are strategy::Slicing and SliceKind (Split is the micro-batch trait only)'
  'on_device::select\b|the choice between the host and the device path is tensor_comm::select_transport'
)
# The deprecated aliases themselves, the test of every public path, the changelog and the rename table (docs/concepts.md)
# name the old paths.
allowed='crates/burn-accelerate/src/distributed/stages/mod.rs|tests/suite/public_paths.rs|CHANGELOG.md|scripts/retired-names.sh|docs/concepts.md'
found=0
for entry in "${retired[@]}"; do
  pattern="${entry%|*}"
  instead="${entry##*|}"
  hits=$(grep -rnE "$pattern" crates tests examples benches docs README.md scripts --include='*.rs' --include='*.md' \
    --include='*.sh' --include='*.py' | grep -vE "^($allowed):" || true)
  if [ -n "$hits" ]; then
    printf 'retired name `%s` (%s):\n%s\n' "$pattern" "$instead" "$hits" >&2
    found=1
  fi
done
[ "$found" = 0 ] && echo "retired names: none in use"
exit "$found"
