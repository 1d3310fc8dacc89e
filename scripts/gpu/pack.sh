#!/usr/bin/env bash
# Packs the GPU kit: everything a GPU machine that reaches nothing (no registry, no Rust toolchain) needs to run
# every GPU check of this project in one call of scripts/gpu/run.sh.
#
#   scripts/gpu/pack.sh                    # build (cuda + vulkan, Burn's fusion and autotuning on) and pack
#   scripts/gpu/pack.sh --binary PATH      # pack a kit binary built already (CI builds one with cuda-bare)
#
# The kit (default target/gpu-kit/, ignored by git; KIT_DIR to change) holds:
#   burn-accelerate-gpu-kit.xz  the stripped multi-call binary (the CLI, the quicktour, memory, data_parallel,
#                               sharded_training, learner and transformer_lm examples, the overhead and throughput benches),
#                               xz-compressed
#   lib/libvulkan.so.1          the Vulkan loader, from Debian's libvulkan1 package (the GPU image has none)
#   lib/libGLdispatch.so.0 ...  GLVND's dispatch libraries (libglvnd0, libglx0, libegl1), which the NVIDIA driver's
#                               Vulkan library loads (without them the loader finds no adapter)
#   MANIFEST                    what was built, from which commit, with which features, and each file's sha256
# The PyTorch + Accelerate comparison (scripts/gpu/torch_throughput.py) and run.sh travel with the working tree.
# The kit must leave room for the tree in the 64 MiB a device call carries: this script fails above 56 MiB.
#
# Environment: KIT_DIR (where to pack), KIT_XZ_LEVEL (default 9; CI uses 1 for speed), PYTHON (for the LLVM SDK).
set -euo pipefail
cd "$(dirname "$0")/../.."

kit="${KIT_DIR:-target/gpu-kit}"
level="${KIT_XZ_LEVEL:-9}"
limit=$((56 * 1024 * 1024))
features="flex,cuda,vulkan,gpu-kit"
binary=""
if [ "${1:-}" = "--binary" ]; then
  binary="${2:?--binary needs the path of a built burn-accelerate-gpu-kit}"
  features="(prebuilt: $binary)"
fi

say() { printf 'pack: %s\n' "$*" >&2; }

if [ -z "$binary" ]; then
  # Burn's CUDA compiler links a static LLVM 23, installed from PyPI (see scripts/llvm-sdk.sh).
  scripts/llvm-sdk.sh
  say "building the kit binary ($features), release"
  # The kit measures: the library at full optimisation (the workspace's release profile builds it at 0 for the
  # tests' sake, see Cargo.toml).
  cargo build --release --config 'profile.release.package.burn-accelerate.opt-level=3' \
    -p burn-accelerate-cli --no-default-features --features "$features" --bin burn-accelerate-gpu-kit
  binary=target/release/burn-accelerate-gpu-kit
fi
[ -x "$binary" ] || { say "no kit binary at $binary"; exit 1; }

rm -rf "$kit"
mkdir -p "$kit/lib"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

say "stripping and compressing $(du -h "$binary" | cut -f1) (xz -$level)"
strip -o "$work/burn-accelerate-gpu-kit" "$binary"
xz -"$level" -T0 -c "$work/burn-accelerate-gpu-kit" >"$kit/burn-accelerate-gpu-kit.xz"

# The Vulkan loader and GLVND's libraries from Debian's packages (apt-get download works unprivileged and
# offline-cached).
say "fetching the Vulkan loader and GLVND (Debian libvulkan1, libglvnd0, libglx0, libegl1)"
(cd "$work" && apt-get download libvulkan1 libglvnd0 libglx0 libegl1 >/dev/null 2>&1) || {
  say "apt-get download libvulkan1 libglvnd0 libglx0 libegl1 failed (run apt-get update first?)"
  exit 1
}
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/debs"; done
loader="$(find "$work/debs" -name 'libvulkan.so.1.*' -type f | head -n1)"
[ -n "$loader" ] || { say "libvulkan.so.1 not found in the package"; exit 1; }
cp "$loader" "$kit/lib/libvulkan.so.1"
for lib in libGLdispatch.so.0 libGLX.so.0 libEGL.so.1; do
  found="$(find "$work/debs" -name "$lib.*" -type f | head -n1)"
  [ -n "$found" ] || { say "$lib not found in the GLVND packages"; exit 1; }
  cp "$found" "$kit/lib/$lib"
done
vulkan_version="$(basename "$work"/libvulkan1_*.deb .deb)"
glvnd_version="$(basename "$work"/libglvnd0_*.deb .deb)"

{
  echo "burn-accelerate GPU kit"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $(ldd --version 2>/dev/null | head -n1)"
  echo "features: $features"
  echo "binary: $(stat -c %s "$work/burn-accelerate-gpu-kit") bytes stripped"
  echo "needs: $(objdump -T "$work/burn-accelerate-gpu-kit" | grep -oE 'GLIBC_[0-9.]+' | sort -uV | tail -n1 | sed 's/_/ >= /'), $(ldd "$work/burn-accelerate-gpu-kit" | awk '/=>/ {print $1}' | tr '\n' ' ')"
  echo "vulkan loader: $vulkan_version, $glvnd_version"
  echo "programs: burn-accelerate quicktour memory data_parallel sharded_training learner overhead throughput"
  (cd "$kit" && sha256sum burn-accelerate-gpu-kit.xz lib/*)
} >"$kit/MANIFEST"

size=$(du -sb "$kit" | cut -f1)
cat "$kit/MANIFEST" >&2
say "kit: $kit, $((size / 1024 / 1024)) MiB ($size bytes) of at most 56 MiB"
ls -l "$kit" "$kit/lib" >&2
if [ "$size" -gt "$limit" ]; then
  say "the kit is larger than 56 MiB: it would leave no room for the working tree in a device call"
  exit 1
fi
echo "$kit"
