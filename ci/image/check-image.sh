#!/usr/bin/env bash
# Run the built image (no GPU needed) and check what `make image` promises: SGLang and
# kvcached import, the patched modules import from the image's SGLang checkout and
# scripts/status says the series is applied there, kvcached's autopatch swaps SGLang's
# KV pools with ENABLE_KVCACHED=true (the image's default) and leaves them with false,
# and SGLang's server command starts (`sglang serve --help`, the entry point SGLang 0.5.20
# recommends). Stops at the first failed check.
#
#   ci/image/check-image.sh [TAG]     (default sglang-elastic-hicache:<SGLANG_VERSION>)
#
# CONTAINER_ENGINE, IMAGE_RUN_FLAGS: as ci/image/engine.sh picks them (docker when its
# daemon answers, else podman, as make image; runc where crun refuses the host's cgroups;
# the host's limits for containers).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=../../sglang.pin
. "$root/sglang.pin"
tag=${1:-sglang-elastic-hicache:$SGLANG_VERSION}
# shellcheck source=engine.sh
. "$root/ci/image/engine.sh"
[ -z "$engine_error" ] || { echo "error: $engine_error" >&2; exit 2; }
"${engine_cmd[@]}" image inspect "$tag" >/dev/null 2>&1 || { echo "error: no image $tag (make image first)" >&2; exit 2; }

run() {  # run ENV_ASSIGNMENTS... -- COMMAND...: one container, its output shown
  local envs=()
  while [ "$1" != "--" ]; do envs+=(-e "$1"); shift; done
  shift
  # shellcheck disable=SC2086
  "${engine_cmd[@]}" run --rm $run_flags "${envs[@]}" "$tag" "$@"
}
check() { printf '\n== %s\n' "$1"; }

check "image $tag: $("${engine_cmd[@]}" image inspect --format '{{.Id}} {{.Size}}' "$tag")"

check "import sglang, kvcached"
run -- python3 -c 'import importlib.metadata as m, sglang, kvcached, torch
print("sglang", m.version("sglang"), sglang.__file__)
print("kvcached", m.version("kvcached"), kvcached.__file__)
print("torch", torch.__version__, "CUDA", torch.version.cuda)'

check "the patched modules import from the checkout; scripts/status"
run -- bash -c 'cd / && python3 -c "import sglang.srt.mem_cache.pool_host.common as c; print(c.__file__)" \
  && python3 /opt/elastic-hicache/scripts/status /sgl-workspace/sglang'

# kvcached's .pth hooks `import sglang`; with ENABLE_KVCACHED true its patches replace
# the memory pool module's classes by its Elastic ones.
pools='import os, sglang, importlib
m = importlib.import_module("sglang.srt.mem_cache.memory_pool")
names = [getattr(m, n).__name__ for n in ("MHATokenToKVPool", "MLATokenToKVPool", "MambaPool")]
print("ENABLE_KVCACHED=%s KVCACHED_AUTOPATCH=%s" % (os.environ.get("ENABLE_KVCACHED"), os.environ.get("KVCACHED_AUTOPATCH")), *names)
want = os.environ["WANT"]
assert all(n.startswith("Elastic") is (want == "elastic") for n in names), names'
check "kvcached's autopatch, the image's default (ENABLE_KVCACHED=true)"
run WANT=elastic -- python3 -c "$pools"
check "kvcached's autopatch off (ENABLE_KVCACHED=false)"
run ENABLE_KVCACHED=false WANT=sglang -- python3 -c "$pools"

check "sglang serve --help"
out=$(run -- sglang serve --help)
# Here-strings, not pipes: a reader that stops early (head, grep -q) would make the
# writer's SIGPIPE fail the script under pipefail.
head -n 5 <<< "$out"
printf '... (%s lines)\n' "$(wc -l <<< "$out")"
grep -q -- '--enable-hierarchical-cache' <<< "$out" \
  || { echo "error: --help does not list --enable-hierarchical-cache" >&2; exit 1; }
printf '\nok: every check passed\n'
