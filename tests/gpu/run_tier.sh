#!/usr/bin/env bash
# The GPU tier: every test under tests/gpu once per kvcached layout (kvcached reads the
# layout at import). Needs a CUDA GPU, kvcached 0.1.6 and the SGLang tree under test on
# PYTHONPATH. Results: one JSON line per test in $GPU_RESULTS (default
# build/gpu-results.jsonl), summarised by hand in docs/harness.md and results/.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 1
export GPU_RESULTS=${GPU_RESULTS:-$root/build/gpu-results.jsonl}
mkdir -p "$(dirname "$GPU_RESULTS")"
status=0
# The series' upstream-style unit tests: their CUDA kernel cases need no kvcached.
if [ -z "${GPU_TESTS:-}" ]; then
  echo "== tests/upstream"
  python3 -m pytest -q -p no:cacheprovider tests/upstream "$@" || status=1
fi
# A GDN state cell (over 2 MiB) needs 4 MiB kvcached pages; KV pools keep kvcached's
# default 2 MiB pages.
# GPU_LAYOUTS, GPU_PARTS (kv, mamba) and GPU_TESTS (test files, default all of tests/gpu)
# narrow a run.
# GPU_TESTS is split at spaces and globbed (tests/gpu/test_*.py): unquoted on purpose.
# shellcheck disable=SC2086
for contiguous in ${GPU_LAYOUTS:-true false}; do
  echo "== kvcached KVCACHED_CONTIGUOUS_LAYOUT=$contiguous"
  if [[ " ${GPU_PARTS:-kv mamba} " == *" kv "* ]]; then
    KVCACHED_CONTIGUOUS_LAYOUT=$contiguous KVCACHED_PAGE_SIZE_MB=2 \
      python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu} -k "not mamba" "$@" || status=1
  fi
  if [[ " ${GPU_PARTS:-kv mamba} " == *" mamba "* ]]; then
    KVCACHED_CONTIGUOUS_LAYOUT=$contiguous KVCACHED_PAGE_SIZE_MB=4 \
      python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu} -k "mamba" "$@" || status=1
  fi
done
exit $status
