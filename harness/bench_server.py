"""SGLang's own benchmark client against SGLang's server: kvcached vs native, HiCache on.

    python -m harness.bench_server --pristine-path P --patched-path Q --out build/bench-server \\
        [--shapes llama3-8b deepseek-v2-lite qwen3.5-4b] [--turns 1 4] [--rounds 3] [--server-flags "..."]
    python -m harness.bench_server --render build/bench-server/report.json   (the markdown summary)
    python -m harness.bench_server --plot build/bench-server/report.json OUT.png

Per shape (a model shape with dummy weights: its config and a word-level tokenizer are
written under OUT/models), one server per variant, all started once, side by side on one
GPU (CUDA graphs as SGLang captures them by default), from the trees the comparison uses
(--pristine-path: SGLang 0.5.20 as released; --patched-path: with the series):
  native               pristine tree, kvcached off, HiCache on (the baseline)
  kvcached-contiguous  patched tree, ENABLE_KVCACHED=true, KVCACHED_CONTIGUOUS_LAYOUT=true, HiCache on
  kvcached-per-layer   the same, KVCACHED_CONTIGUOUS_LAYOUT=false
  native-no-hicache    pristine tree, kvcached off, HiCache off
  kvcached-no-hicache  patched tree, kvcached contiguous, HiCache off; only when named (with
                       native-no-hicache, which it is divided by): kvcached's own cost, apart
                       from HiCache's copies (the series')
  kvcached-contiguous-reserved  kvcached-contiguous with every freed page kept mapped
                       (KVCACHED_MAX_RESERVED_PAGES); only when named: kvcached's unmapping
                       and mapping again, apart from the rest of its cost
  kvcached-default-cap kvcached-contiguous with kvcached's own cap of 16000 cached tokens
                       (what the image serves with unless told); only when named
Every server caps its device pool (--max-total-tokens, --device-tokens) below the working
set, so that most prefix hits come back from host, and gets a host pool that holds the
working set (--hicache-ratio, by default the smallest that does, with a fifth to spare).
Then, after --warmup-rounds left out of the ratios (the first runs after the servers start
pay one-off costs), round after round, each variant is benchmarked once, the order rotated
each round (A B C D, B C D A, ...): `python -m sglang.bench_serving --dataset-name
generated-shared-prefix` (groups of prompts sharing a system prompt; with --turns T > 1
multi-turn conversations over the chat endpoint, `--gsp-num-turns T`), `--cache-report`
(device and host hit tokens), `--flush-cache` after its warm-up request (every run starts
from empty caches, device and host: SGLang 0.5.20's flush clears both), the same seed (the
same prompts) everywhere. Each variant's result is divided by its baseline's of the same
round (native's; kvcached-no-hicache's by native-no-hicache's):
the report gives, per metric (request and output token throughput, TTFT mean / p50 / p99,
ITL p50), the median of those per-round ratios and their spread (min, max over rounds),
native's own values and spread, and the device/host split of the cached tokens; the
kvcached variants with HiCache on against the targets (>= 0.98 of native's throughput,
TTFT within 1.02x): met, short only within the spread, or short beyond it.

Files under --out: report.json (every run, rewritten as the run goes), summary.md (the
markdown, also `--render`), ratios.png (with matplotlib), raw/ (bench_serving's own JSONL
lines), logs/ (servers' and clients' output), models/ and client-home/ (the client's
prompt cache: ~/.cache/sglang/benchmark under it). Exit status: 0 every run measured, 1 a
problem (listed in the report), 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness import project, servers
from harness.compare import verdict as judge

CLIENT_STANDIN = Path(__file__).resolve().parent / "rig" / "standin" / "bench_client"


@dataclass(frozen=True)
class Shape:
    """A model shape: an HF config served with dummy weights, and how to serve it."""
    name: str
    what: str                                  # one line for the report
    config: dict
    page_size: int = 64
    flags: tuple[str, ...] = ()
    kvcached_env: tuple[tuple[str, str], ...] = ()


_LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2}
# DeepSeek-V2-Lite's attention: MLA, 27 layers, 16 heads, kv_lora_rank 512 + rope 64; its MLPs
# dense (first_k_dense_replace = every layer) instead of its 64-expert MoE: the KV path is
# what is compared, and the MoE would add sglang-kernel's MoE ops to what must load
_DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
    "first_k_dense_replace": 27, "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "norm_topk_prob": False, "scoring_func": "softmax", "routed_scaling_factor": 1.0, "vocab_size": 102400,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "rope_scaling": None,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 1, "eos_token_id": 2}
# Qwen3.5-4B's text model: 32 layers, full attention every 4th (16 heads, 4 KV heads of 256),
# the others gated delta-net linear attention (16 key heads, 32 value heads of 128, conv 4)
_QWEN35_4B = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 2560,
    "intermediate_size": 9216, "num_hidden_layers": 32, "full_attention_interval": 4, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "attn_output_gate": True, "partial_rotary_factor": 0.25, "rope_theta": 10000000, "mamba_ssm_dtype": "float32",
    "vocab_size": 248320, "max_position_embeddings": 8192, "rms_norm_eps": 1e-06, "hidden_act": "silu",
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}}

SHAPES = {s.name: s for s in (
    Shape("llama3-8b", "Llama-3-8B-shaped MHA: 32 layers, 8 KV heads x 128, bf16", _LLAMA3_8B),
    # page size 1: kvcached 0.1.6's elastic MLA allocator holds page_size times the tokens
    # asked for (harness/compare/matrix.py, _MLA), which would keep on the device what native evicts
    Shape("deepseek-v2-lite", "DeepSeek-V2-Lite-shaped MLA: 27 layers, 512 + 64 bf16, dense MLPs",
          _DEEPSEEK_V2_LITE, page_size=1),
    # a Mamba cell (2 MiB SSM + 48 KiB conv per layer) is over kvcached's default 2 MiB page
    Shape("qwen3.5-4b", "Qwen3.5-4B-shaped Mamba hybrid: 8 full-attention layers (4 KV heads x 256), "
          "24 gated delta-net layers", _QWEN35_4B, flags=("--max-mamba-cache-size", "64"),
          kvcached_env=(("KVCACHED_PAGE_SIZE_MB", "4"),)),
)}


@dataclass(frozen=True)
class Variant:
    name: str
    tree: str                  # "pristine" (SGLang 0.5.20 as released) or "patched" (the series)
    layout: str | None         # kvcached's layout; None: kvcached off
    hicache: bool
    baseline: str = "native"   # the variant its ratios divide by
    kvcached_env: tuple[tuple[str, str], ...] = ()   # kvcached settings of this variant only


# kvcached 0.1.6 unmaps a freed page once 10 free ones are mapped (KVCACHED_MAX_RESERVED_PAGES),
# and maps one again at the next allocation: under HiCache's eviction and reload the pool
# churns through both. kvcached caps the setting at the pool's page count, so this keeps every
# page that was ever used mapped, as a native pool is.
KEEP_PAGES_MAPPED = (("KVCACHED_MAX_RESERVED_PAGES", "1000000"),)
# kvcached 0.1.6's own cap on the tokens SGLang keeps cached (what a server gets unless told
# otherwise, the image's too); every other kvcached variant takes --kvcached-max-cached-tokens.
KVCACHED_DEFAULT_CAP = (("KVCACHED_MAX_CACHED_TOKENS", "16000"),)

VARIANTS = {v.name: v for v in (
    Variant("native", "pristine", None, True),
    Variant("kvcached-contiguous", "patched", "contiguous", True),
    Variant("kvcached-per-layer", "patched", "per-layer", True),
    Variant("kvcached-contiguous-reserved", "patched", "contiguous", True, kvcached_env=KEEP_PAGES_MAPPED),
    Variant("kvcached-default-cap", "patched", "contiguous", True, kvcached_env=KVCACHED_DEFAULT_CAP),
    Variant("native-no-hicache", "pristine", None, False),
    Variant("kvcached-no-hicache", "patched", "contiguous", False, baseline="native-no-hicache"),
)}
BASELINE = "native"

# (bench_serving's result key, what the report calls it, which way is better)
METRICS = (("request_throughput", "req/s", "higher"), ("output_throughput", "output tok/s", "higher"),
           ("mean_ttft_ms", "TTFT mean ms", "lower"), ("median_ttft_ms", "TTFT p50 ms", "lower"),
           ("p99_ttft_ms", "TTFT p99 ms", "lower"), ("median_itl_ms", "ITL p50 ms", "lower"))
KEPT = (*(m for m, _, _ in METRICS), "completed", "duration", "total_input_tokens", "total_output_tokens",
        "input_throughput", "mean_itl_ms", "p99_itl_ms", "mean_e2e_latency_ms", "median_e2e_latency_ms")
# the targets for kvcached, as ratios to native
TARGETS = {"request_throughput": 0.98, "output_throughput": 0.98, "mean_ttft_ms": 1.02, "median_ttft_ms": 1.02}


@dataclass(frozen=True)
class Sizes:
    """The generated-shared-prefix workload and the device pool (tokens)."""
    groups: int = 24
    prompts_per_group: int = 6
    system_prompt_len: int = 4096
    question_len: int = 128
    output_len: int = 32
    concurrency: int = 8
    device_tokens: int = 49152

    def answers(self, turns: int) -> int:
        """Requests the client counts: one per prompt and turn."""
        return self.groups * self.prompts_per_group * turns

    def working_set(self, turns: int) -> int:
        """Distinct tokens the run puts in the cache: the system prompts once, every turn's
        question and answer."""
        return self.groups * self.system_prompt_len + self.answers(turns) * (self.question_len + self.output_len)

    def longest(self, turns: int) -> int:
        return self.system_prompt_len + turns * (self.question_len + self.output_len)


def hicache_ratio(sizes: Sizes, turns: int) -> int:
    """The smallest whole --hicache-ratio whose host pool holds the working set with a fifth
    to spare (SGLang wants the host pool larger than the device pool: 2 at least)."""
    return max(2, math.ceil(1.2 * sizes.working_set(turns) / sizes.device_tokens))


def host_pool_bytes(shape: Shape, sizes: Sizes, ratio: int) -> int:
    """About what one HiCache server pins in host memory: its host KV pool (ratio x the
    device pool) and, for a Mamba hybrid, its host state pool (ratio x the state slots)."""
    c = shape.config
    layers = c["num_hidden_layers"]
    if "kv_lora_rank" in c:                                      # MLA: one latent row a token
        per_token = layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
    else:
        full = layers // c.get("full_attention_interval", 1)
        per_token = full * 2 * c["num_key_value_heads"] * c["head_dim"] * 2
    total = ratio * sizes.device_tokens * per_token
    if "linear_num_value_heads" in c:                            # conv (bf16) + SSM (fp32) state per slot
        conv = (2 * c["linear_num_key_heads"] * c["linear_key_head_dim"]
                + c["linear_num_value_heads"] * c["linear_value_head_dim"]) * (c["linear_conv_kernel_dim"] - 1) * 2
        ssm = c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"] * 4
        slots = int(shape.flags[shape.flags.index("--max-mamba-cache-size") + 1])
        total += ratio * slots * (layers - layers // c["full_attention_interval"]) * (conv + ssm)
    return total


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo, bytes; None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ---- the model folder: config and tokenizer ---------------------------------------------

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def write_model(folder: Path, shape: Shape, context: int) -> Path:
    """config.json, and a word-level tokenizer whose vocabulary is the model's: token i is
    the word `t<i>`, text is words separated by spaces, so decoding any ids and encoding the
    text again gives the same ids (the client's prompt lengths are exact, a conversation's
    turns extend each other token for token); its chat template joins the messages' text."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {**shape.config, "max_position_embeddings": max(shape.config["max_position_embeddings"], context)}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                 "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}, indent=1))
    return folder


# ---- servers and clients -----------------------------------------------------------------

def server_args(shape: Shape, variant: Variant, model: Path, port: int, sizes: Sizes, ratio: int,
                mem_fraction: float, extra=()) -> list[str]:
    """`sglang.launch_server` arguments; within a shape the variants differ in HiCache only."""
    args = ["--model-path", str(model), "--host", "127.0.0.1", "--port", str(port), "--nccl-port", str(port + 1),
            "--load-format", "dummy", "--page-size", str(shape.page_size),
            "--max-total-tokens", str(sizes.device_tokens), "--mem-fraction-static", f"{mem_fraction:g}",
            *shape.flags]
    if variant.hicache:
        args += ["--enable-hierarchical-cache", "--hicache-ratio", str(ratio)]
    return args + list(extra)


def server_env(shape: Shape, variant: Variant, ipc: str, max_cached_tokens: int) -> dict[str, str]:
    if variant.layout is None:
        return {"ENABLE_KVCACHED": "false"}
    return {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "true" if variant.layout == "contiguous" else "false",
            "KVCACHED_IPC_NAME": ipc, "KVCACHED_MAX_CACHED_TOKENS": str(max_cached_tokens), **dict(shape.kvcached_env),
            **dict(variant.kvcached_env)}


def client_args(sizes: Sizes, turns: int, base: str, model: Path, out_file: Path, seed: int, tag: str) -> list[str]:
    """bench_serving's arguments (sglang/benchmark/serving.py, 0.5.20): multi-turn takes the
    chat endpoint (its only multi-turn backend); --gsp-range-ratio stays 1 (fixed lengths)."""
    return ["--backend", "sglang" if turns == 1 else "sglang-oai-chat", "--base-url", base,
            "--model", str(model), "--tokenizer", str(model), "--dataset-name", "generated-shared-prefix",
            "--gsp-num-groups", str(sizes.groups), "--gsp-prompts-per-group", str(sizes.prompts_per_group),
            "--gsp-system-prompt-len", str(sizes.system_prompt_len), "--gsp-question-len", str(sizes.question_len),
            "--gsp-output-len", str(sizes.output_len), "--gsp-num-turns", str(turns),
            "--num-prompts", str(sizes.groups * sizes.prompts_per_group), "--max-concurrency", str(sizes.concurrency),
            "--seed", str(seed), "--cache-report", "--flush-cache", "--disable-tqdm",
            "--output-file", str(out_file), "--tag", tag]


def round_orders(variants: list[str], rounds: int) -> list[list[str]]:
    """Each round every variant once, the order rotated by one each round."""
    n = len(variants)
    return [[variants[(r + i) % n] for i in range(n)] for r in range(rounds)]


def workload(turns: int) -> str:
    return "shared-prefix" if turns == 1 else f"multi-turn-{turns}"


# ---- arithmetic and report ---------------------------------------------------------------

def summarize(runs: list[dict], variants: list[str]) -> dict:
    """Per variant: each metric's values by round, its ratios to its baseline's value of the
    same round (native's, but kvcached-no-hicache's are to native-no-hicache's), their median
    and spread; the cached tokens by tier."""
    rounds = sorted({r["round"] for r in runs})
    got = {(r["round"], r["variant"]): r for r in runs if r.get("metrics")}
    out = {}
    for v in variants:
        entry = {"metrics": {}, "cache": {}}
        for m, _, _ in METRICS:
            values = [got[(k, v)]["metrics"].get(m) if (k, v) in got else None for k in rounds]
            baseline = VARIANTS[v].baseline
            base = [got[(k, baseline)]["metrics"].get(m) if (k, baseline) in got else None for k in rounds]
            ratios = [x / b if x is not None and b else None for x, b in zip(values, base)]
            have, rs = [x for x in values if x is not None], [x for x in ratios if x is not None]
            entry["metrics"][m] = {
                "values": values, "median": statistics.median(have) if have else None,
                "min_value": min(have, default=None), "max_value": max(have, default=None),
                "ratios": ratios, "ratio": statistics.median(rs) if rs else None,
                "min": min(rs, default=None), "max": max(rs, default=None)}
        caches = [got[(k, v)].get("cache") or {} for k in rounds if (k, v) in got]
        device = sum(c.get("device_cached_tokens") or 0 for c in caches)
        host = sum(c.get("host_cached_tokens") or 0 for c in caches)
        entry["cache"] = {"device_tokens": device, "host_tokens": host,
                          "cached_tokens": sum(c.get("total_cached_tokens") or 0 for c in caches),
                          "host_share": host / (device + host) if device + host else None,
                          "per_round": [{k: c.get(k) for k in ("device_cached_tokens", "host_cached_tokens",
                                                               "total_cached_tokens")} for c in caches]}
        if VARIANTS[v].layout and VARIANTS[v].hicache:
            entry["targets"] = {m: target_verdict(entry["metrics"][m], t) for m, t in TARGETS.items()}
        out[v] = entry
    return out


def target_verdict(stat: dict, target: float) -> str:
    """'met' (the median ratio meets it), 'within spread' (the median misses, some round
    meets it) or 'short' (every round misses it); throughput targets are floors, TTFT ones
    ceilings. A single measured round has no spread and is not judged."""
    if stat["ratio"] is None:
        return "not measured"
    measured = [r for r in stat.get("ratios") or [] if r is not None]
    if stat.get("ratios") is not None and len(measured) < 2:
        return "not judged (one round: no spread)"
    floor = target < 1
    meets = (lambda x: x >= target) if floor else (lambda x: x <= target)
    if meets(stat["ratio"]):
        return "met"
    return "within spread" if meets(stat["max"] if floor else stat["min"]) else "short"


def problems_of(report: dict) -> list[str]:
    """What makes the run incomplete or its numbers meaningless."""
    out = []
    for shape, s in report["shapes"].items():
        for v, srv in s["servers"].items():
            if srv.get("outcome") not in (None, "ready"):
                out.append(f"{shape}/{v}: server {srv['outcome']}: {srv.get('error') or 'no error line in its log'}")
            if srv.get("outcome") == "ready" and bool(srv.get("kvcached_lines")) != bool(VARIANTS[v].layout):
                out.append(f"{shape}/{v}: kvcached {'on' if VARIANTS[v].layout else 'off'}, but its log has "
                           f"{len(srv.get('kvcached_lines') or [])} kvcached allocation lines")
        for name, w in s["workloads"].items():
            want = w["answers"]
            for r in w.get("warmup", []):
                if r.get("error"):
                    out.append(f"{shape}/{name} warm-up {r['round'] + 1} {r['variant']}: {r['error']}")
            for r in w["runs"]:
                where = f"{shape}/{name} round {r['round'] + 1} {r['variant']}"
                if r.get("error"):
                    out.append(f"{where}: {r['error']}")
                elif r["metrics"].get("completed") != want:
                    out.append(f"{where}: {r['metrics'].get('completed')} of {want} requests completed")
                elif VARIANTS[r["variant"]].hicache and not (r.get("cache") or {}).get("host_cached_tokens"):
                    out.append(f"{where}: no host-hit tokens: the device pool held the working set")
                elif not VARIANTS[r["variant"]].hicache and (r.get("cache") or {}).get("host_cached_tokens"):
                    out.append(f"{where}: host-hit tokens with HiCache off")
    return out


def baseline_of(variant: str) -> str:
    """The variant a variant's ratios divide by (native for one this tool no longer runs)."""
    return VARIANTS[variant].baseline if variant in VARIANTS else BASELINE


def summary(report: dict) -> dict:
    """What a committed summary keeps of a report (results/): what render() and plot() read,
    the per-round values and ratios included; not the client runs, servers or argv."""
    c = report["config"]
    keep = ("values", "median", "min_value", "max_value", "ratios", "ratio", "min", "max")
    return {
        "config": {k: c.get(k) for k in ("variants", "rounds", "warmup_rounds", "turns", "sizes", "server_flags")},
        "environment": {"versions": {"sglang": ((report.get("environment") or {}).get("versions") or {}).get("sglang")}},
        "shapes": {name: {"what": s["what"], "hicache_ratio": s["hicache_ratio"], "workloads": {
            w_name: {"working_set": w["working_set"], "answers": w["answers"], "summary": {
                v: {"metrics": {m: {k: st.get(k) for k in keep} for m, st in e["metrics"].items()},
                    "cache": {k: e["cache"].get(k) for k in ("device_tokens", "host_tokens", "cached_tokens",
                                                             "host_share")},
                    **({"targets": e["targets"]} if e.get("targets") else {})}
                for v, e in w["summary"].items()}}
            for w_name, w in s["workloads"].items()}} for name, s in report["shapes"].items()},
        "problems": report.get("problems") or []}


def fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(report: dict) -> str:
    """The markdown summary of a report."""
    c = report["config"]
    versions = (report.get("environment") or {}).get("versions")
    sglang = versions.get("sglang") if isinstance(versions, dict) else None
    lines = [f"# Server benchmark: kvcached vs native SGLang{' ' + sglang if sglang else ''}, HiCache on", "",
             f"SGLang's own client (`python -m sglang.bench_serving`, generated-shared-prefix), {c['rounds']} rounds"
             + (f" after {c['warmup_rounds']} not counted (warm-up)" if c.get("warmup_rounds") else "")
             + f", each variant once a round, the order rotated; every variant's value divided by native's of "
             f"the same round (a row that names another baseline: by that one's): median ratio (min-max over "
             f"rounds). Throughput: higher is better; TTFT and ITL: lower. "
             f"Device pool {c['sizes']['device_tokens']} tokens; {c['sizes']['groups']} groups x "
             f"{c['sizes']['prompts_per_group']} prompts, system prompt {c['sizes']['system_prompt_len']}, question "
             f"{c['sizes']['question_len']}, output {c['sizes']['output_len']} tokens, {c['sizes']['concurrency']} "
             f"concurrent; CUDA graphs on; server flags: `{' '.join(c['server_flags']) or 'none'}`."]
    heads = [label for _, label, _ in METRICS]
    for shape, s in report["shapes"].items():
        for name, w in s["workloads"].items():
            lines += ["", f"## {shape}, {name}", "", f"{s['what']}; host pool: --hicache-ratio {s['hicache_ratio']} "
                      f"(working set {w['working_set']} tokens); {w['answers']} requests a run.", "",
                      "| variant | " + " | ".join(heads) + " | cached tokens: device / host (host share) |",
                      "|---|" + "---|" * (len(heads) + 1)]
            for v, e in w["summary"].items():
                if v == BASELINE:
                    cells = [f"{fmt(st['median'], 2)} ({fmt(st['min_value'], 2)}-{fmt(st['max_value'], 2)})"
                             for st in (e["metrics"][m] for m, _, _ in METRICS)]
                else:
                    cells = [f"{fmt(st['ratio'])} ({fmt(st['min'])}-{fmt(st['max'])})"
                             for st in (e["metrics"][m] for m, _, _ in METRICS)]
                ca = e["cache"]
                share = "-" if ca["host_share"] is None else f"{100 * ca['host_share']:.0f} %"
                of = f" (to {baseline_of(v)})" if baseline_of(v) != BASELINE else ""
                lines.append(f"| {v}{' (values)' if v == BASELINE else of} | " + " | ".join(cells)
                             + f" | {ca['device_tokens']} / {ca['host_tokens']} ({share}) |")
            for v, e in w["summary"].items():
                if e.get("targets"):
                    lines.append("")
                    lines.append(f"{v} against the targets (throughput >= 0.98, TTFT <= 1.02 of native): "
                                 + ", ".join(f"{dict((m, l) for m, l, _ in METRICS)[m]} "
                                             f"{target_verdict(e['metrics'][m], t)}"  # judged as rendered
                                             for m, t in TARGETS.items()) + ".")
    if report.get("problems"):
        lines += ["", "## Problems", ""] + [f"- {p}" for p in report["problems"]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    """Each variant's median ratios with their spread, one panel per shape and workload;
    False without matplotlib."""
    panels = [(shape, name, w) for shape, s in report["shapes"].items() for name, w in s["workloads"].items()]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.6 * max(1, len(panels))), squeeze=False)
    for ax, (shape, name, w) in zip(axes[:, 0], panels):
        others = [v for v in w["summary"] if v != BASELINE]
        width = 0.8 / max(1, len(others))
        for i, v in enumerate(others):
            stats = [w["summary"][v]["metrics"][m] for m, _, _ in METRICS]
            xs = [j + (i - (len(others) - 1) / 2) * width for j in range(len(METRICS))]
            mid = [s["ratio"] or 0 for s in stats]
            low = [(s["ratio"] or 0) - (s["min"] or 0) for s in stats]
            high = [(s["max"] or 0) - (s["ratio"] or 0) for s in stats]
            of = f" (to {baseline_of(v)})" if baseline_of(v) != BASELINE else ""
            ax.bar(xs, mid, width, yerr=[low, high], capsize=3, label=v + of)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(METRICS)), [label for _, label, _ in METRICS])
        ax.set_ylabel("ratio to native (or the baseline named)")
        ax.set_title(f"{shape}, {name}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---- the run -----------------------------------------------------------------------------

class Interrupted(Exception):
    """SIGTERM or SIGINT reached the harness."""


@dataclass
class ShapeServers:
    shape: Shape
    model: Path
    ratio: int
    members: dict[str, servers.Server] = field(default_factory=dict)


class Bench:
    def __init__(self, opts):
        self.opts = opts
        self.out = Path(opts.out)
        self.sizes = Sizes(opts.groups, opts.prompts_per_group, opts.system_prompt_len, opts.question_len,
                           opts.output_len, opts.concurrency, opts.device_tokens)
        self.extra_flags = servers.split_flags(opts.server_flags)
        self.extra_env = servers.parse_env(opts.env)
        self.client = shlex.split(opts.bench_client) if opts.bench_client else [opts.python, "-m", "sglang.bench_serving"]
        self.live: list[servers.Server] = []
        self.stopping = False
        self.datasets_missing: bool | None = None
        self.started = time.time()
        self.report = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:],
            "config": {"variants": opts.variants, "rounds": opts.rounds, "warmup_rounds": opts.warmup_rounds,
                       "turns": opts.turns, "seed": opts.seed,
                       "sizes": asdict(self.sizes), "mem_fraction_static": opts.mem_fraction_static,
                       "kvcached_max_cached_tokens": opts.kvcached_max_cached_tokens,
                       "server_flags": self.extra_flags, "env": self.extra_env, "gpu": opts.gpu,
                       "client": self.client},
            "patches": project.patches_state()["digest"], "shapes": {}, "problems": []}

    def log(self, text: str) -> None:
        print(f"[{time.time() - self.started:6.0f} s] {text}", flush=True)

    def save(self) -> None:
        self.report["problems"] = problems_of(self.report)
        self.report["wall_s"] = round(time.time() - self.started, 1)
        tmp = self.out / "report.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1))
        tmp.replace(self.out / "report.json")

    def stop_all(self, *_) -> None:
        """SIGTERM/SIGINT: stop at once; run() stops the servers and writes the report (a
        further signal meanwhile is ignored: raised there, it would cut that short)."""
        if self.stopping:
            return
        self.stopping = True
        raise Interrupted()

    def plan(self, shape: Shape, base: int) -> ShapeServers:
        """The shape's model folder and its servers, one a variant on ports base + 10 * i."""
        o, sizes = self.opts, self.sizes
        model = write_model(self.out / "models" / shape.name, shape, sizes.longest(max(o.turns)) + 64)
        fleet = ShapeServers(shape, model, o.hicache_ratio or max(hicache_ratio(sizes, t) for t in o.turns))
        deep_gemm = shape.config["model_type"].startswith("deepseek") and servers.lacks(o.python, "deep_gemm")
        logs = self.out / "logs" / shape.name
        logs.mkdir(parents=True, exist_ok=True)
        for i, name in enumerate(o.variants):
            v = VARIANTS[name]
            port = base + 10 * i
            env = {**self.extra_env, **server_env(shape, v, f"bench{os.getpid()}_{shape.name}_{name}".replace(".", "-"),
                                                  o.kvcached_max_cached_tokens)}
            if deep_gemm:
                env.setdefault("SGLANG_ENABLE_JIT_DEEPGEMM", "false")
            args = server_args(shape, v, model, port, sizes, fleet.ratio, o.mem_fraction_static, self.extra_flags)
            tree = o.pristine_path if v.tree == "pristine" else o.patched_path
            fleet.members[name] = servers.local_server(o.python, args, port, logs / f"{name}.log", env, tree,
                                                       gpus=o.gpu, standin=deep_gemm)
        return fleet

    def launch(self, shape: Shape) -> ShapeServers:
        o = self.opts
        base = o.port or servers.free_port_block(len(o.variants))
        fleet = self.plan(shape, base)
        record = self.report["shapes"][shape.name] = {
            "what": shape.what, "hicache_ratio": fleet.ratio, "model": str(fleet.model), "workloads": {},
            "servers": {n: {"command": s.command, "env": s.env, "port": s.port, "log": str(s.log)}
                        for n, s in fleet.members.items()}}
        self.log(f"{shape.name}: starting {', '.join(o.variants)} (ports {base}-{base + 10 * len(o.variants) - 9})")
        began = time.time()
        for server in fleet.members.values():
            server.log.write_text("")
        self.live += fleet.members.values()
        why = servers.start_all(fleet.members, o.ready_timeout)
        for name, server in fleet.members.items():
            scan = judge.scan_log(server.log_text())
            record["servers"][name].update(outcome=why[name] or "ready", start_s=round(time.time() - began, 1),
                                           kvcached_lines=scan["kvcached_lines"], error=scan["error"])
        self.log(f"{shape.name}: " + ", ".join(f"{n} {why[n] or 'ready'}" for n in fleet.members))
        return fleet

    def bench_once(self, fleet: ShapeServers, variant: str, rnd: int, position: int, turns: int,
                   label: str) -> dict:
        o, name = self.opts, workload(turns)
        server = fleet.members[variant]
        raw = self.out / "raw" / fleet.shape.name / name
        logs = self.out / "logs" / fleet.shape.name / name
        raw.mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
        out_file = raw / f"{label}-{variant}.jsonl"
        out_file.unlink(missing_ok=True)
        command = [*self.client, *client_args(self.sizes, turns, server.base, fleet.model, out_file, o.seed,
                                              f"{fleet.shape.name}/{name}/{label}/{variant}")]
        rec = {"round": rnd, "position": position, "variant": variant, "port": server.port, "raw": str(out_file),
               "metrics": {}}
        if not server.running():
            return {**rec, "error": "the server is not running"}
        began = time.time()
        log = logs / f"{label}-{variant}.client.log"
        with open(log, "w") as handle:
            client = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=self.client_env(fleet),
                                      start_new_session=True)
        try:
            client.wait(timeout=o.bench_timeout)
        except subprocess.TimeoutExpired:
            servers.stop(client, grace=5)
            return {**rec, "error": f"the client ran past --bench-timeout {o.bench_timeout:.0f} s"}
        finally:
            if client.poll() is None:
                servers.stop(client, grace=5)
        rec["s"] = round(time.time() - began, 1)
        lines = [line for line in (out_file.read_text().splitlines() if out_file.exists() else []) if line.strip()]
        if client.returncode or not lines:
            tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or ["no output"]
            died = "" if server.running() else "; the server died"
            return {**rec, "error": f"the client exited {client.returncode} without a result{died}: {tail[0][:200]}"}
        result = json.loads(lines[-1])
        rec["metrics"] = {k: result.get(k) for k in KEPT}
        rec["cache"] = result.get("cache_report")
        return rec

    def client_env(self, fleet: ShapeServers) -> dict[str, str]:
        """The client's environment: SGLang from --client-path, its own HOME (bench_serving
        caches generated prompts under ~/.cache/sglang/benchmark, keyed by the tokenizer's
        class only: one cache per shape), the datasets stand-in where datasets is missing."""
        home = self.out / "client-home" / fleet.shape.name
        home.mkdir(parents=True, exist_ok=True)
        first = [str(Path(self.opts.client_path).resolve())] if self.opts.client_path else []
        env = servers.local_env({"HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, first)
        if self.datasets_missing is None:
            self.datasets_missing = servers.lacks(self.opts.python, "datasets", env)
        if self.datasets_missing:
            env["PYTHONPATH"] += ":" + str(CLIENT_STANDIN)
        return env

    def run_shape(self, shape: Shape) -> None:
        o = self.opts
        fleet = self.launch(shape)
        record = self.report["shapes"][shape.name]
        try:
            if any(why != "ready" for why in (s["outcome"] for s in record["servers"].values())):
                return
            for turns in o.turns:
                record["workloads"][workload(turns)] = {"turns": turns, "answers": self.sizes.answers(turns),
                                                        "working_set": self.sizes.working_set(turns), "runs": [],
                                                        "warmup": [], "summary": {}}
            # Warm-up rounds first, left out of the ratios: the first client runs after the
            # servers start pay one-off costs (Triton compiling for new shapes, into a cache the
            # servers share), which would fall on whichever variant runs first.
            for warmup, rounds in ((True, o.warmup_rounds), (False, o.rounds)):
                for rnd, order in enumerate(round_orders(o.variants, rounds)):
                    for turns in o.turns:
                        self.run_round(fleet, record["workloads"][workload(turns)], rnd, order, turns, warmup)
        finally:
            self.stop(fleet)

    def run_round(self, fleet: ShapeServers, w: dict, rnd: int, order: list[str], turns: int,
                  warmup: bool) -> None:
        """Every variant once, in ``order``; a warm-up round's runs go to w["warmup"], the
        others to w["runs"] and the summary."""
        o, name = self.opts, fleet.shape.name
        for position, variant in enumerate(order):
            if o.deadline is not None and time.time() - self.started > o.deadline:
                rec = {"round": rnd, "position": position, "variant": variant, "metrics": {},
                       "error": f"not run: --deadline {o.deadline:.0f} s had passed"}
            else:
                label = f"{'w' if warmup else 'r'}{rnd + 1}"
                rec = self.bench_once(fleet, variant, rnd, position, turns, label)
            w["warmup" if warmup else "runs"].append(rec)
            if not warmup:
                w["summary"] = summarize(w["runs"], o.variants)
            self.save()
            m = rec["metrics"]
            self.log(f"{name} {workload(turns)} {'warm-up' if warmup else 'round'} {rnd + 1} {variant}: "
                     + (rec["error"] if rec.get("error") else
                        f"{fmt(m.get('request_throughput'), 2)} req/s, TTFT p50 {fmt(m.get('median_ttft_ms'), 1)} ms"
                        + (" (not counted)" if warmup else "")))

    def stop(self, fleet: ShapeServers) -> None:
        servers.stop_all(fleet.members.values())
        self.live = [s for s in self.live if s not in fleet.members.values()]

    def check_memory(self) -> None:
        """Refuse, before any server starts, host pools that would not fit in memory."""
        o, free = self.opts, available_memory()
        hicache = sum(VARIANTS[v].hicache for v in o.variants)
        for name in o.shapes:
            ratio = o.hicache_ratio or max(hicache_ratio(self.sizes, t) for t in o.turns)
            need = hicache * host_pool_bytes(SHAPES[name], self.sizes, ratio)
            if free is not None and need > 0.8 * free:
                raise SystemExit(f"error: {name}: {hicache} host pools of about {need / hicache / 2**30:.1f} GiB "
                                 f"(--hicache-ratio {ratio}) need more than 80 % of the {free / 2**30:.0f} GiB "
                                 "available: lower --device-tokens, --hicache-ratio or the workload's sizes")

    def run(self) -> int:
        o = self.opts
        self.check_memory()
        self.report["trees"] = project.check_trees(o.pristine_path, o.patched_path)
        self.report["environment"] = servers.machine(o.python, o.patched_path)
        try:
            for name in o.shapes:
                self.run_shape(SHAPES[name])
        except Interrupted:
            self.report["interrupted"] = True
            for server in self.live:
                server.stop()
        self.save()
        summary = render(self.report)
        (self.out / "summary.md").write_text(summary)
        if not plot(self.report, self.out / "ratios.png"):
            print("matplotlib missing: no plot (pip install matplotlib; then --plot REPORT OUT.png)")
        print(summary)
        return 1 if self.report["problems"] or self.report.get("interrupted") else 0


def options(argv=None):
    sizes = Sizes()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--render", metavar="REPORT", help="print a report's markdown summary, exit")
    ap.add_argument("--plot", nargs=2, metavar=("REPORT", "PNG"), help="draw a report's ratios, exit")
    ap.add_argument("--dry-run", action="store_true", help="print each server's and the first client's command, exit")
    ap.add_argument("--out", default="build/bench-server", help="folder of the report and everything else")
    ap.add_argument("--shapes", nargs="+", default=["llama3-8b"], choices=sorted(SHAPES))
    ap.add_argument("--variants", nargs="+",
                    default=["native", "kvcached-contiguous", "kvcached-per-layer", "native-no-hicache"],
                    choices=list(VARIANTS), help="native is the baseline: always among them")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every variant once (3 at least for a spread)")
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="rounds of every variant once before those, left out of the ratios (the first runs "
                         "after the servers start pay one-off costs)")
    ap.add_argument("--turns", nargs="+", type=int, default=[1],
                    help="one workload each: 1 shared-prefix prompts, T > 1 conversations of T turns")
    ap.add_argument("--groups", type=int, default=sizes.groups, help="--gsp-num-groups")
    ap.add_argument("--prompts-per-group", type=int, default=sizes.prompts_per_group)
    ap.add_argument("--system-prompt-len", type=int, default=sizes.system_prompt_len)
    ap.add_argument("--question-len", type=int, default=sizes.question_len)
    ap.add_argument("--output-len", type=int, default=sizes.output_len)
    ap.add_argument("--concurrency", type=int, default=sizes.concurrency, help="--max-concurrency of the client")
    ap.add_argument("--device-tokens", type=int, default=sizes.device_tokens, help="--max-total-tokens of every server")
    ap.add_argument("--hicache-ratio", type=int, help="default: the smallest whose host pool holds the working set")
    ap.add_argument("--mem-fraction-static", type=float, default=0.8,
                    help="SGLang 0.5.20 keeps (1 - this) of the free memory it saw before loading weights as "
                         "slack and sizes the pool from the rest: with several servers loading side by side the "
                         "rest must stay above the capped pool")
    ap.add_argument("--kvcached-max-cached-tokens", type=int, default=-1,
                    help="KVCACHED_MAX_CACHED_TOKENS (-1: keep every cached prefix, as native does; kvcached's "
                         "default drops those beyond 16,000 tokens after each request)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pristine-path", help="folder holding SGLang 0.5.20's sglang/ as released (harness/trees.sh)")
    ap.add_argument("--patched-path", help="folder holding sglang/ with the series applied")
    ap.add_argument("--python", default=sys.executable, help="the servers' and the client's interpreter")
    ap.add_argument("--client-path", help="folder first on the client's PYTHONPATH (default: --pristine-path)")
    ap.add_argument("--bench-client", help="the client command instead of `PYTHON -m sglang.bench_serving`")
    ap.add_argument("--server-flags", action="append", default=[], help="more launch_server flags for every server")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="more server environment")
    ap.add_argument("--gpu", default="0", help="CUDA_VISIBLE_DEVICES of every server (one GPU)")
    ap.add_argument("--port", type=int, help="first port (default: a free block)")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--bench-timeout", type=float, default=600, help="seconds one client run may take")
    ap.add_argument("--deadline", type=float, help="start no client run after this many seconds (it is 'not run')")
    opts = ap.parse_args(argv)
    if opts.render or opts.plot:
        return opts
    if BASELINE not in opts.variants or len(set(opts.variants)) != len(opts.variants):
        ap.error("--variants must name native (the baseline) and each variant once")
    if missing := [f"{v} needs {VARIANTS[v].baseline}" for v in opts.variants if VARIANTS[v].baseline not in opts.variants]:
        ap.error(f"--variants: {', '.join(missing)} (its ratios divide by it)")
    if opts.rounds < 1 or opts.warmup_rounds < 0 or min(opts.turns) < 1 or len(set(opts.turns)) != len(opts.turns):
        ap.error("--rounds must be at least 1, --warmup-rounds at least 0 and --turns distinct counts of at least 1")
    sizes = Sizes(opts.groups, opts.prompts_per_group, opts.system_prompt_len, opts.question_len, opts.output_len,
                  opts.concurrency, opts.device_tokens)
    if min(asdict(sizes).values()) < 1:
        ap.error("sizes (--groups ... --device-tokens) must be positive")
    if sizes.longest(max(opts.turns)) > sizes.device_tokens:
        ap.error(f"a request of {sizes.longest(max(opts.turns))} tokens would not fit in a device pool of "
                 f"{sizes.device_tokens} (--device-tokens)")
    if opts.hicache_ratio is not None and opts.hicache_ratio < 2:
        ap.error("--hicache-ratio must be at least 2 (SGLang wants the host pool larger than the device pool)")
    if not 0 < opts.mem_fraction_static < 1:
        ap.error("--mem-fraction-static must be between 0 and 1")
    if not (opts.pristine_path and opts.patched_path):
        ap.error("--pristine-path and --patched-path are needed: folders holding sglang/ "
                 "(harness/trees.sh makes them)")
    try:
        servers.parse_env(opts.env)
        servers.split_flags(opts.server_flags)
        servers.split_flags([opts.bench_client or ""], "--bench-client")
    except ValueError as exc:
        ap.error(str(exc))
    if why := project.make_out(opts.out, folder=True):
        ap.error(why)
    opts.client_path = opts.client_path or opts.pristine_path
    return opts


def dry_run(opts) -> int:
    bench = Bench(opts)
    for name in opts.shapes:
        fleet = bench.plan(SHAPES[name], opts.port or 30000)
        for v, server in fleet.members.items():
            print(f"# {name} {v} ({VARIANTS[v].tree} tree)\n" + " ".join(f"{k}={x}" for k, x in server.env.items())
                  + " " + shlex.join(server.command))
        for turns in opts.turns:
            print(f"# client, {workload(turns)}\n" + shlex.join(
                [*bench.client, *client_args(bench.sizes, turns, fleet.members[BASELINE].base, fleet.model,
                                             bench.out / "raw" / "r1-native.jsonl", opts.seed, "dry-run")]))
    return 0


def main(argv=None) -> int:
    opts = options(argv)
    if opts.render or opts.plot:
        path = Path(opts.render or opts.plot[0])
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"error: cannot read the report {path}: {exc}", file=sys.stderr)
            return 2
        try:
            if opts.render:
                print(render(report), end="")
                return 0
            if not plot(report, Path(opts.plot[1])):
                print("error: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
                return 2
        except (KeyError, TypeError, AttributeError) as exc:    # another tool's report (soak's, compare's)
            print(f"error: {path}: not a bench_server.py report ({type(exc).__name__}: {exc})", file=sys.stderr)
            return 2
        return 0
    if opts.dry_run:
        return dry_run(opts)
    bench = Bench(opts)
    return servers.with_signals(bench.stop_all, bench.run)


if __name__ == "__main__":
    sys.exit(main())
