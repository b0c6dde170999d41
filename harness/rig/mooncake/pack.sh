#!/usr/bin/env bash
# Usage: harness/rig/mooncake/pack.sh [OUT.tar.xz]   (on a machine with PyPI; default .mc/mooncake-0.3.13.post1.tar.xz)
# Packs mooncake-transfer-engine-non-cuda 0.3.13.post1 (requirements/cpu.txt's pin; cp312)
# for a GPU machine without network, as a site folder with its dist-info: the store client
# SGLang's MooncakeStore imports (store.so), mooncake_master and the libraries they load
# (about 15 MB). Left out: transfer_engine_bench and mooncake_client. The machine must have
# libibverbs1, libnuma1 and libcurl4 (the H200 machines' Ubuntu 24.04 image does).
# There: tar xJf OUT -C /tmp/mooncake, then put /tmp/mooncake/site on the servers' PYTHONPATH.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,8s/^# \{0,1\}//p' "$0"; exit 0;; esac
root=$(git rev-parse --show-toplevel)
out=${1:-$root/.mc/mooncake-0.3.13.post1.tar.xz}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$(dirname "$out")" "$work/site"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$work" mooncake-transfer-engine-non-cuda==0.3.13.post1
(cd "$work/site" && unzip -q ../mooncake_transfer_engine_non_cuda-*.whl \
  -x 'mooncake/transfer_engine_bench' 'mooncake/mooncake_client')
tar cf - -C "$work" site | xz -9e -T2 > "$out"
echo "$out: $(du -h "$out" | cut -f1)"
