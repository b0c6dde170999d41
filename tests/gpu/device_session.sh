#!/usr/bin/env bash
# One call on the lent GPU machine (see docs/gpu-results.md): the GPU tier on pristine
# SGLang 0.5.20 (expected to fail), then on the patched tree, then the benchmark.
# Usage there: source .device/setup.sh; bash tests/gpu/device_session.sh $OUT
set -uo pipefail
out=${1:?output folder}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1
python3 -c "import torch, kvcached, sglang; print('torch', torch.__version__, 'cuda', torch.version.cuda); print('kvcached', kvcached.__version__); print('sglang', sglang.__version__)" >> "$out/gpu.txt" 2>&1
if [ "${SKIP_UNPATCHED:-0}" != 1 ]; then
  GPU_TRIPS=${UNPATCHED_TRIPS:-10} GPU_RESULTS=$out/unpatched.jsonl bash tests/gpu/run_tier.sh --tb=line -rf \
    > "$out/unpatched.log" 2>&1
  echo "unpatched tier exit: $?" >> "$out/unpatched.log"
fi
python3 scripts/apply /tmp/site > "$out/apply.log" 2>&1 || { cat "$out/apply.log"; exit 1; }
GPU_RESULTS=$out/patched.jsonl bash tests/gpu/run_tier.sh --tb=short -rA > "$out/patched.log" 2>&1
echo "patched tier exit: $?" >> "$out/patched.log"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 bench/transfer_bench.py --out "$out/bench.json" ${BENCH_ARGS:-} > "$out/bench.log" 2>&1
  echo "bench exit: $?" >> "$out/bench.log"
fi
tail -n 5 "$out/unpatched.log" 2>/dev/null; tail -n 25 "$out/patched.log"; tail -n 70 "$out/bench.log" 2>/dev/null
