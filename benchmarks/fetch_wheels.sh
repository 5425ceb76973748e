#!/usr/bin/env bash
# The wheels a device call needs that the GPU image lacks, into .whl/ (git-ignored; carry
# [".whl"]): jax-linear-attention and FLA (the anchors), grain and its needs (a training run),
# jla's own needs (.whl/jla), and wrapt / attrs where the image lacks them (.whl/extra).
# Then on the device: `source benchmarks/device_env.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
get() { local dir=$1; shift; python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$dir" "$@"; }
get .whl jax-linear-attention==0.1.0 fla-core==0.6.0 grain==0.2.18 array-record portpicker dm-tree
get .whl/jla equinox jaxtyping wadler-lindig safetensors
get .whl/extra wrapt attrs
mkdir -p .whl/patches
ls .whl .whl/jla .whl/extra
