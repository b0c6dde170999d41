#!/usr/bin/env bash
# One call on a GPU machine without network (harness/rig/README.md), where SGLang 0.5.20 and
# kvcached 0.1.6 are installed into $SGLANG_SITE (default /tmp/site): keep a pristine copy of
# SGLang for the benchmark's native variant, apply the series to the installed tree, then run the steps named in $STEPS:
#   unpatched  the GPU tier on the pristine copy (expected to fail; $UNPATCHED_TRIPS trips)
#   tier       the GPU tier on the patched tree ($GPU_LAYOUTS, $GPU_PARTS, $GPU_TESTS, $GPU_TRIPS:
#              tests/gpu/run_tier.sh)
#   bench      python3 -m harness.transfer_bench, native = the pristine copy ($BENCH_ARGS, e.g. --parts)
#   differential  the differential cases (docs/differential.md) on SGLang's dense device pools,
#              pristine copy vs patched tree, real JIT kernels ($DIFF_ARGS, e.g. --case mha*: split
#              at spaces, no quotes, no file-name globbing)
# REAL_KERNELS=1 runs every step on sglang-kernel 0.4.5's compiled ops (harness/rig/real_kernels:
# .e2e/sgl_kernel_045_sm90.tgz) in place of the import stand-in, and writes which ops ran to
# $out/sgl_kernel_ops.json.
# Usage there, with $SGLANG_SITE on PYTHONPATH: STEPS="tier bench" bash harness/rig/device_session.sh $OUT
set -uo pipefail
out=${1:?output folder}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 1
site=${SGLANG_SITE:-/tmp/site}
pristine=${PRISTINE_SITE:-/tmp/pristine}
steps=${STEPS:-tier bench}
if [ -n "${REAL_KERNELS:-}" ]; then
  export SGLK_REAL_LOG=$out/sgl_kernel_real_ops.log
  # shellcheck source=real_kernels/setup.sh
  source harness/rig/real_kernels/setup.sh > "$out/real-kernels.log" 2>&1 || { cat "$out/real-kernels.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1
python3 -c "import torch, kvcached, sglang; print('torch', torch.__version__, 'cuda', torch.version.cuda); print('kvcached', kvcached.__version__); print('sglang', sglang.__version__)" >> "$out/gpu.txt" 2>&1
if [ ! -d "$pristine/sglang" ]; then
  mkdir -p "$pristine" && cp -a "$site/sglang" "$pristine/"
fi
# The copy is of $site as it stands, which an earlier call may have patched: take the
# series out (a no-op on a pristine tree), and stop unless scripts/status finds none of
# the series in it and no file missing, edited outside the series' changes, or stray.
python3 scripts/reverse "$pristine" > "$out/pristine-reverse.log" 2>&1
python3 scripts/status "$pristine" > "$out/pristine-status.txt" 2> "$out/pristine-status.err"
if ! grep -q "^SGLang .*: series pristine$" "$out/pristine-status.txt" \
    || grep -qE "^(missing|local edits|foreign)" "$out/pristine-status.txt"; then
  echo "no pristine SGLang at $pristine for the native variant:" >&2
  cat "$out/pristine-reverse.log" "$out/pristine-status.txt" "$out/pristine-status.err" >&2
  exit 1
fi
has() { [[ " $steps " == *" $1 "* ]]; }
if has unpatched; then
  PYTHONPATH=$pristine${PYTHONPATH:+:$PYTHONPATH} GPU_TRIPS=${UNPATCHED_TRIPS:-10} GPU_RESULTS=$out/unpatched.jsonl \
    bash tests/gpu/run_tier.sh --tb=line -rf > "$out/unpatched.log" 2>&1
  echo "unpatched tier exit: $?" >> "$out/unpatched.log"
fi
python3 scripts/apply "$site" > "$out/apply.log" 2>&1 || { cat "$out/apply.log"; exit 1; }
if has tier; then
  GPU_RESULTS=$out/patched.jsonl bash tests/gpu/run_tier.sh --tb=short -rA > "$out/patched.log" 2>&1
  echo "patched tier exit: $?" >> "$out/patched.log"
fi
if has differential; then
  read -r -a diff_args <<< "${DIFF_ARGS:-}"  # words, not file names: --case mha* stays a pattern
  python3 -m harness.differential.pair --pristine "$pristine" --patched "$site" \
    --out "$out/differential" --device cuda --real-kernels "${diff_args[@]}" > "$out/differential.log" 2>&1
  echo "differential exit: $?" >> "$out/differential.log"
fi
if has bench; then
  read -r -a bench_args <<< "${BENCH_ARGS:-}"  # options: split at spaces, not globbed
  python3 -m harness.transfer_bench --native-sglang "$pristine" --out "$out/bench.json" "${bench_args[@]}" \
    > "$out/bench.log" 2>&1
  echo "bench exit: $?" >> "$out/bench.log"
fi
if [ -n "${REAL_KERNELS:-}" ]; then
  python3 -m harness.rig.real_kernels.sgl_kernel_calls --summary "$SGLK_REAL_LOG" --out "$out/sgl_kernel_ops.json" \
    ${SGLK_CALL_LOG:+--stand-in-log "$SGLK_CALL_LOG"} \
    >> "$out/real-kernels.log" 2>&1
  echo "== real sgl_kernel"; cat "$out/real-kernels.log"
fi
for f in unpatched patched differential bench; do
  [ -f "$out/$f.log" ] && { echo "== $f"; grep -E "passed|failed|exit:|GB/s|cases|differ|^\|" "$out/$f.log" | tail -n 60; }
done
exit 0  # each step's exit status is the last line of its log
