#!/usr/bin/env bash
# Installs the static LLVM 23 SDK that Burn's CUDA backend links against, from PyPI, so that
# `cargo build --features cuda` works without the bundle download that `cubecl-cuda`'s build step makes
# from outside the package registries.
#
# Burn's CUDA compiler (`cubecl-cuda` -> `cubecl-llvm` -> `tracel-llvm-bundler` 23.1.0-4) skips its download
# when `<data dir>/tracel/tracel-llvm-23.1.0-4/.tracel-llvm-installed` exists and then links through
# `<that folder>/bin/llvm-config --link-static`. PyPI's `mlc-llvm-static` and `mlc-llvm-static-extra-targets`
# (23.1.1, both wheels unpacked into one folder) are a relocatable static LLVM SDK with the NVPTX and AMDGPU
# targets and such an `llvm-config`. This script downloads the two wheels (pinned by hash), unpacks them into a
# cache folder, points the bundler's folder at it and writes the marker.
#
# Usage: scripts/llvm-sdk.sh            # then: cargo build --release --no-default-features --features cuda
# Environment:
#   BURN_ACCELERATE_LLVM_SDK  where the SDK is unpacked (default: ${XDG_CACHE_HOME:-~/.cache}/burn-accelerate/llvm-sdk-23.1.1)
#   XDG_DATA_HOME             the bundler's data folder, as it reads it (default: ~/.local/share)
#   PYTHON                    the Python whose pip downloads the wheels (default: python3; a venv is made if it has no pip)
# Idempotent: a second run with the SDK in place only checks it.
set -euo pipefail

version=23.1.1.post0
bundler_dir="${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-23.1.0-4"
sdk="${BURN_ACCELERATE_LLVM_SDK:-${XDG_CACHE_HOME:-$HOME/.cache}/burn-accelerate/llvm-sdk-23.1.1}"
python="${PYTHON:-python3}"

say() { printf 'llvm-sdk: %s\n' "$*" >&2; }

if [ ! -x "$sdk/mlc_llvm_static/static/bin/llvm-config" ] || [ ! -f "$sdk/.complete" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  if ! "$python" -m pip --version >/dev/null 2>&1; then
    say "$python has no pip; making a venv for the download"
    "$python" -m venv "$work/venv"
    python="$work/venv/bin/python"
  fi
  cat >"$work/requirements.txt" <<EOF
mlc-llvm-static==$version --hash=sha256:dcfec888abfaa418be77d41af585805f31463584cf9c90582992c00f392c1ac5
mlc-llvm-static-extra-targets==$version --hash=sha256:c36e834d9a4e9cf9759f27fece65711ece7a2fc2b5a96dbb15d66f5e9e787929
EOF
  say "downloading mlc-llvm-static $version (+ extra targets) from PyPI"
  "$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --python-version 3.11 --require-hashes \
    -r "$work/requirements.txt" -d "$work/wheels"
  rm -rf "$sdk"
  mkdir -p "$sdk"
  for wheel in "$work"/wheels/*.whl; do
    "$python" -m zipfile -e "$wheel" "$sdk"
  done
  # The wheels' zip entries carry no execute bits; `llvm-config` is a Python script run directly.
  chmod +x "$sdk"/mlc_llvm_static/static/bin/*
  touch "$sdk/.complete"
fi

prefix="$sdk/mlc_llvm_static/static"
[ "$("$prefix/bin/llvm-config" --version)" = "23.1.1" ] || { say "$prefix/bin/llvm-config is not LLVM 23.1.1"; exit 1; }
"$prefix/bin/llvm-config" --targets-built | grep -qw NVPTX || { say "the SDK lacks the NVPTX target"; exit 1; }

mkdir -p "$(dirname "$bundler_dir")"
if [ -L "$bundler_dir" ] || [ ! -e "$bundler_dir" ]; then
  ln -sfn "$prefix" "$bundler_dir"
elif [ ! -f "$bundler_dir/.tracel-llvm-installed" ]; then
  say "$bundler_dir exists and is not this SDK; move it away and run again"
  exit 1
fi
touch "$bundler_dir/.tracel-llvm-installed"
say "ready: $bundler_dir -> $prefix"
echo "$prefix"
