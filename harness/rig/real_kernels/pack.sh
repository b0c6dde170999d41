#!/usr/bin/env bash
# Usage: harness/rig/real_kernels/pack.sh [OUT.tgz]   (on a machine with PyPI; default .e2e/sgl_kernel_045_sm90.tgz)
# Packs sglang-kernel 0.4.5's sgl_kernel package with only the libraries its import loads
# on a Hopper GPU (sm90/common_ops, spatial_ops: about 15 MB), for GPU machines whose
# torch is 2.11 (0.4.5 is the last sglang-kernel built for it). Left out, loaded lazily or
# for other GPUs: flash_ops (FA3), flashmla_ops, infllm_ops, sm100/. Unpack it with
# harness/rig/real_kernels/setup.sh on the GPU machine.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,7s/^# \{0,1\}//p' "$0"; exit 0;; esac
root=$(git rev-parse --show-toplevel)
out=${1:-$root/.e2e/sgl_kernel_045_sm90.tgz}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$(dirname "$out")"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d "$work" sglang-kernel==0.4.5
(cd "$work" && unzip -q sglang_kernel-0.4.5-*.whl 'sgl_kernel/*' \
  -x 'sgl_kernel/*flash_ops*' 'sgl_kernel/*flashmla_ops*' 'sgl_kernel/*infllm_ops*' 'sgl_kernel/sm100/*')
tar czf "$out" -C "$work" sgl_kernel
echo "$out: $(du -h "$out" | cut -f1)"
