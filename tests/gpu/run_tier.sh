#!/usr/bin/env bash
# The GPU tier: every test under tests/gpu once per kvcached layout (kvcached reads the
# layout at import). Needs a CUDA GPU, kvcached 0.1.6 and the SGLang tree under test on
# PYTHONPATH. Results: one JSON line per test in $GPU_RESULTS (default
# build/gpu-results.jsonl); tests/gpu/report.py turns them into docs/gpu-results.md.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
export GPU_RESULTS=${GPU_RESULTS:-$root/build/gpu-results.jsonl}
mkdir -p "$(dirname "$GPU_RESULTS")"
status=0
for contiguous in true false; do
  echo "== kvcached KVCACHED_CONTIGUOUS_LAYOUT=$contiguous"
  KVCACHED_CONTIGUOUS_LAYOUT=$contiguous python3 -m pytest -q -p no:cacheprovider tests/gpu "$@" || status=1
done
exit $status
