#!/usr/bin/env python3
"""Model-level check: native SGLang vs the patched image with kvcached, same GPU, same flags.

    python3 ci/e2e/compare_servers.py --case qwen2.5-0.5b [--layout default|layer_first]
        [--launcher docker|local] [--native-image IMG] [--patched-image IMG] [--out report.json]
    python3 ci/e2e/compare_servers.py --case tiny-dummy --launcher local     (no weights)

For each case it starts native SGLang 0.5.20 (kvcached off), runs the passes, stops it,
then starts the patched build with kvcached on (ENABLE_KVCACHED=true,
KVCACHED_MAX_CACHED_TOKENS=-1 so kvcached evicts no more than native would) and runs the
same passes, then compares:

  * greedy output tokens equal, prompt by prompt;
  * top-5 logprobs of every output position within --logprob-tol (same top token);
  * host-cache hit tokens per prompt on the second pass equal native's, and > 0.

Passes: pass 1 sends the prompt set (HiCache writes it through to host); an eviction
pass sends distinct filler prompts totalling more tokens than the device pool holds
(the server runs with a small --max-total-tokens), so the first set leaves the device;
pass 2 sends the prompt set again, and its prefixes come back from host. (Not
/flush_cache: in SGLang 0.5.20 it resets the whole tree *and* clears the host pool,
UnifiedRadixCache._reset_full, so nothing would load from host afterwards.)

Prompts are token ids (input_ids) with --skip-tokenizer-init, so the dummy-weight case
needs no tokenizer and no download. Not run on our machines (no GPU server there): the
argument building, the flags (against SGLang's own parser) and the comparison are tested
in the CPU tier (tests/cpu/test_e2e_compare.py).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Case:
    model: str
    tp: int = 1
    extra_flags: tuple[str, ...] = ()
    kvcached_page_size_mb: int | None = None  # a Mamba cell over 2 MiB needs 4
    vocab_size: int = 32000                    # prompt token ids are drawn below this
    dummy: bool = False                        # --load-format dummy, local config folder


CASES = {
    "qwen2.5-0.5b": Case("Qwen/Qwen2.5-0.5B-Instruct", vocab_size=151000),
    "qwen2.5-7b": Case("Qwen/Qwen2.5-7B-Instruct", vocab_size=151000),
    "qwen2.5-7b-tp2": Case("Qwen/Qwen2.5-7B-Instruct", tp=2, vocab_size=151000),
    "deepseek-v2-lite": Case("deepseek-ai/DeepSeek-V2-Lite-Chat", extra_flags=("--trust-remote-code",),
                             vocab_size=100000),
    "qwen3.5-4b": Case("Qwen/Qwen3.5-4B", kvcached_page_size_mb=4, vocab_size=151000),
    "tiny-dummy": Case(str(HERE / "configs" / "qwen2-tiny"), vocab_size=1024, dummy=True),
}
LAYOUTS = {"default": (), "layer_first": ("--hicache-mem-layout", "layer_first")}


@dataclass
class Plan:
    prompts: int = 16
    prompt_tokens: int = 512
    max_new_tokens: int = 16
    device_tokens: int = 8192        # --max-total-tokens: the device pool the filler overflows
    hicache_ratio: int = 4           # host pool: holds the prompt set and the filler together
    page_size: int = 64
    top_logprobs: int = 5
    seed: int = 0


def server_args(case: Case, layout: str, port: int, plan: Plan) -> list[str]:
    """`sglang.launch_server` arguments, identical for native and patched runs."""
    args = ["--model-path", case.model, "--host", "127.0.0.1", "--port", str(port),
            "--tp-size", str(case.tp), "--page-size", str(plan.page_size),
            "--max-total-tokens", str(plan.device_tokens),
            "--enable-hierarchical-cache", "--hicache-ratio", str(plan.hicache_ratio), *LAYOUTS[layout],
            "--skip-tokenizer-init", *case.extra_flags]
    if case.dummy:
        args += ["--load-format", "dummy"]
    return args


def server_env(case: Case, patched: bool) -> dict[str, str]:
    if not patched:
        return {"ENABLE_KVCACHED": "false"}
    env = {"ENABLE_KVCACHED": "true", "KVCACHED_MAX_CACHED_TOKENS": "-1"}
    if case.kvcached_page_size_mb:
        env["KVCACHED_PAGE_SIZE_MB"] = str(case.kvcached_page_size_mb)
    return env


def launch_command(launcher: str, image: str | None, env: dict[str, str], args: list[str],
                   gpus: str, mounts: tuple[str, ...] = ()) -> list[str]:
    """The command that starts one server: in a container (docker) or on this host (local)."""
    serve = ["python3", "-m", "sglang.launch_server", *args]
    if launcher == "local":
        return ["env", *(f"{k}={v}" for k, v in sorted(env.items())), *serve]
    if not image:
        raise ValueError("--launcher docker needs an image for this variant")
    command = ["docker", "run", "--rm", "--gpus", f'"device={gpus}"', "--ipc=host", "--network=host",
               "-v", f"{os.path.expanduser('~')}/.cache/huggingface:/root/.cache/huggingface"]
    for mount in mounts:
        command += ["-v", f"{mount}:{mount}:ro"]
    for key, value in sorted(env.items()):
        command += ["-e", f"{key}={value}"]
    return [*command, image, *serve]


def prompt_sets(plan: Plan, vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The prompt set and the eviction filler: fixed token ids, no shared prefixes."""
    rng = random.Random(plan.seed)
    ids = lambda n: [rng.randrange(100, vocab_size) for _ in range(n)]
    prompts = [ids(plan.prompt_tokens) for _ in range(plan.prompts)]
    filler_count = plan.device_tokens // plan.prompt_tokens + 2  # just over the device pool
    filler = [ids(plan.prompt_tokens) for _ in range(filler_count)]
    return prompts, filler


def generate_payload(input_ids: list[int], plan: Plan) -> dict:
    return {"input_ids": input_ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": plan.max_new_tokens, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": plan.top_logprobs, "logprob_start_len": -1}


def summarize(response: dict) -> dict:
    """What the comparison needs from one /generate response."""
    meta = response["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return {
        "output_ids": response.get("output_ids") or [t[1] for t in meta["output_token_logprobs"]],
        "top_logprobs": [[(entry[1], entry[0]) for entry in position]
                         for position in meta["output_top_logprobs"]],
        "cached_tokens": meta.get("cached_tokens", 0),
        "host_tokens": details.get("host", 0),
    }


def compare(native: list[dict], patched: list[dict], logprob_tol: float) -> list[str]:
    """Every difference that makes the patched run wrong; empty when it matches native."""
    problems = []
    if len(native) != len(patched):
        return [f"{len(native)} native responses vs {len(patched)} patched"]
    for i, (a, b) in enumerate(zip(native, patched)):
        if a["output_ids"] != b["output_ids"]:
            first = next((j for j, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])) if x != y),
                         min(len(a["output_ids"]), len(b["output_ids"])))
            problems.append(f"prompt {i}: greedy tokens differ from position {first}")
        for pos, (ta, tb) in enumerate(zip(a["top_logprobs"], b["top_logprobs"])):
            if not ta or not tb or ta[0][0] != tb[0][0]:
                problems.append(f"prompt {i} position {pos}: top token differs")
                continue
            common = dict(ta).keys() & dict(tb).keys()
            worst = max((abs(dict(ta)[t] - dict(tb)[t]) for t in common), default=0.0)
            if worst > logprob_tol:
                problems.append(f"prompt {i} position {pos}: top-{len(ta)} logprobs differ by {worst:.4f}")
        if a["host_tokens"] != b["host_tokens"]:
            problems.append(f"prompt {i}: {b['host_tokens']} host-hit tokens, native {a['host_tokens']}")
    if not any(a["host_tokens"] for a in native):
        problems.append("native never hit the host cache: the eviction pass did not evict (raise the filler)")
    return problems


def post(url: str, payload: dict | None = None, timeout: float = 600) -> dict | str:
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read().decode()
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        return body


def wait_ready(base: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready")
        try:
            post(f"{base}/health_generate", timeout=10)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(5)
    raise TimeoutError(f"server not ready after {timeout:.0f} s")


def run_passes(base: str, prompts: list[list[int]], filler: list[list[int]], plan: Plan) -> list[dict]:
    for ids in prompts:  # pass 1: computed on device, written through to host
        post(f"{base}/generate", generate_payload(ids, plan))
    for ids in filler:   # evict pass 1 from the device pool (not from host)
        post(f"{base}/generate", generate_payload(ids, plan))
    return [summarize(post(f"{base}/generate", generate_payload(ids, plan))) for ids in prompts]


def run_variant(command: list[str], port: int, prompts, filler, plan: Plan, log: Path, ready_timeout: float):
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, process, ready_timeout)
        return run_passes(base, prompts, filler, plan)
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted(CASES), required=True)
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="default")
    ap.add_argument("--launcher", choices=["docker", "local"], default="docker")
    ap.add_argument("--native-image", default="lmsysorg/sglang:v0.5.20-cu130")
    ap.add_argument("--patched-image", default="sglang-elastic-hicache:0.5.20")
    ap.add_argument("--gpus", default="0", help="docker --gpus device list (two for the TP2 case)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--logprob-tol", type=float, default=1e-3)
    ap.add_argument("--ready-timeout", type=float, default=1800)
    ap.add_argument("--out", default="e2e-report.json")
    args = ap.parse_args()

    case, plan = CASES[args.case], Plan()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    prompts, filler = prompt_sets(plan, case.vocab_size)
    mounts = (str(Path(case.model)),) if case.dummy else ()
    results = {}
    for variant, image in (("native", args.native_image), ("patched", args.patched_image)):
        command = launch_command(args.launcher, image, server_env(case, variant == "patched"),
                                 server_args(case, args.layout, args.port, plan), args.gpus, mounts)
        print(f"{variant}: {' '.join(command)}", flush=True)
        results[variant] = run_variant(command, args.port, prompts, filler, plan,
                                       Path(f"{args.out}.{variant}.log"), args.ready_timeout)
    problems = compare(results["native"], results["patched"], args.logprob_tol)
    report = {"case": args.case, "layout": args.layout, "problems": problems,
              "host_tokens": {v: [r["host_tokens"] for r in rs] for v, rs in results.items()}}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print("\n".join(problems) if problems else f"{args.case} {args.layout}: patched matches native")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
