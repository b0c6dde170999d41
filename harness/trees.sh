#!/usr/bin/env bash
# The two SGLang trees harness.compare's local launcher runs, made from the SGLang 0.5.20
# that an interpreter imports (left untouched):
#   OUT/pristine/sglang   a copy as it is; must be pristine (scripts/status)
#   OUT/patched/sglang    a copy with the series applied (scripts/apply)
# Usage: harness/trees.sh [PYTHON] [OUT]   (defaults: python3, build/e2e/trees)
# A server started with OUT/pristine or OUT/patched first on PYTHONPATH imports that copy
# and everything else (kvcached, torch, ...) from the interpreter's environment.
set -euo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
python=${1:-python3}
out=${2:-$root/build/e2e/trees}
pkg=$(ENABLE_KVCACHED=false "$python" -c 'import os, sglang; print(os.path.dirname(os.path.abspath(sglang.__file__)))') \
  || { echo "error: $python cannot import sglang" >&2; exit 1; }
rm -rf "$out/pristine" "$out/patched"
mkdir -p "$out/pristine" "$out/patched"
cp -a "$pkg" "$out/pristine/sglang"
cp -a "$pkg" "$out/patched/sglang"
find "$out" -name __pycache__ -prune -exec rm -rf {} +
state=$("$root/scripts/status" "$out/pristine" | head -n1) || true
case "$state" in
  *"series pristine") ;;
  *) echo "error: the SGLang $python imports ($pkg) is not pristine 0.5.20: $state" >&2; exit 1 ;;
esac
"$root/scripts/apply" "$out/patched"
echo "pristine: $out/pristine  patched: $out/patched  (from $pkg)"
