"""What a sharing run runs: the models, the four variants, the plan (budgets, traffic,
rounds), its presets, and each server's flags and environment.

The budget arithmetic (`budgets`) is the one place that decides how much GPU memory for KV
and how much host memory each server of each variant gets; harness/sharing/__init__.py
says why it makes the totals equal.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from harness import bench_server
from harness.compare import matrix

GIB = 1 << 30
GB = 10 ** 9          # SGLang's --hicache-size unit


# ---- models ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Model:
    """A model served with dummy weights (redrawn at a trained model's scale by
    harness/compare's plugin): its HF config and how SGLang and kvcached serve it."""
    name: str
    what: str
    pool: str                                   # "mha", "mla" or "mamba" (a hybrid)
    config: dict
    folder: str | None = None                   # a config folder of harness/compare; None: written
    page_size: int = 64
    flags: tuple[str, ...] = ()
    kvcached_env: tuple[tuple[str, str], ...] = ()

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    @property
    def context(self) -> int:
        return self.config["max_position_embeddings"]

    def _head_dim(self) -> int:
        c = self.config
        return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]

    def _full_layers(self) -> int:
        c = self.config
        return c["num_hidden_layers"] // c.get("full_attention_interval", 1)

    @property
    def kv_bytes_per_token(self) -> int:
        """Device KV bytes of one token, every layer (bf16): MLA's latent row, else K and V
        of the full-attention layers."""
        c = self.config
        if "kv_lora_rank" in c:
            return c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2
        return self._full_layers() * 2 * c["num_key_value_heads"] * self._head_dim() * 2

    @property
    def kvcached_page_tokens(self) -> int:
        """Tokens on one kvcached page of one layer's buffer (KVCACHED_PAGE_SIZE_MB, 2 by
        default): an elastic pool smaller than a page a layer has no usable page, and its
        server waits at warm-up for ever."""
        c = self.config
        row = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2 if "kv_lora_rank" in c \
            else c["num_key_value_heads"] * self._head_dim() * 2
        return int(dict(self.kvcached_env).get("KVCACHED_PAGE_SIZE_MB", "2")) * (1 << 20) // row

    @property
    def state_slots(self) -> int:
        return int(self.flags[self.flags.index("--max-mamba-cache-size") + 1]) \
            if "--max-mamba-cache-size" in self.flags else 0

    @property
    def state_bytes(self) -> int:
        """A hybrid's Mamba state pool: --max-mamba-cache-size slots of conv (bf16) and SSM
        (fp32) state in every linear layer; 0 for a model without one."""
        c = self.config
        if "linear_num_value_heads" not in c:
            return 0
        conv = (2 * c["linear_num_key_heads"] * c["linear_key_head_dim"]
                + c["linear_num_value_heads"] * c["linear_value_head_dim"]) * (c["linear_conv_kernel_dim"] - 1) * 2
        ssm = c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"] * 4
        return self.state_slots * (c["num_hidden_layers"] - self._full_layers()) * (conv + ssm)

    @property
    def weight_bytes(self) -> int:
        """About the bf16 weights (embeddings, attention, dense MLPs): for the memory estimate."""
        c = self.config
        h, layers = c["hidden_size"], c["num_hidden_layers"]
        embed = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings") else 2)
        mlp = 3 * h * c["intermediate_size"]
        if "kv_lora_rank" in c:
            heads, nope, rope, v = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                                    c["v_head_dim"])
            attn = h * heads * (nope + rope) + h * (c["kv_lora_rank"] + rope) \
                + c["kv_lora_rank"] * heads * (nope + v) + heads * v * h
            return 2 * (embed + layers * (attn + mlp))
        hd, heads, kv = self._head_dim(), c["num_attention_heads"], c["num_key_value_heads"]
        gate = 2 if c.get("attn_output_gate") else 1
        full = h * heads * hd * (gate + 1) + 2 * h * kv * hd
        total = self._full_layers() * full
        if "linear_num_value_heads" in c:
            nk, nv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                              c["linear_value_head_dim"])
            total += (layers - self._full_layers()) * (h * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * h)
        return 2 * (embed + total + layers * mlp)

    def path(self, models_dir: Path, write: bool = True) -> Path:
        """The --model-path: harness/compare's config folder, or config.json written under models_dir."""
        if self.folder:
            return Path(self.folder)
        folder = models_dir / self.name
        if not write:
            return folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config, indent=1) + "\n")
        return folder


def _compare_config(name: str) -> dict:
    return json.loads((matrix.CONFIGS / name / "config.json").read_text())


_LLAMA32_1B = {**bench_server.SHAPES["llama3-8b"].config, "hidden_size": 2048, "intermediate_size": 8192,
               "num_hidden_layers": 16, "head_dim": 64, "max_position_embeddings": 131072,
               "tie_word_embeddings": True}
_MAMBA = (("KVCACHED_PAGE_SIZE_MB", "4"),)     # a Mamba cell (2 MiB SSM + 48 KiB conv a layer) is over 2 MiB

MODELS = {m.name: m for m in (
    # harness/compare's tiny configs: every pool kind in seconds (the smoke preset)
    Model("qwen2-tiny", "harness/compare's qwen2-tiny (MHA, 4 layers)", "mha", _compare_config("qwen2-tiny"),
          str(matrix.CONFIGS / "qwen2-tiny")),
    # page size 1: kvcached 0.1.6's elastic MLA allocator holds page_size times the tokens asked
    # for (harness/compare/matrix.py, _MLA)
    Model("deepseek-v2-tiny", "harness/compare's deepseek-v2-tiny (MLA, 4 layers)", "mla",
          _compare_config("deepseek-v2-tiny"), str(matrix.CONFIGS / "deepseek-v2-tiny"), page_size=1),
    Model("qwen3.5-tiny", "harness/compare's qwen3.5-tiny (Mamba hybrid, 4 layers)", "mamba",
          _compare_config("qwen3.5-tiny"), str(matrix.CONFIGS / "qwen3.5-tiny"),
          flags=("--max-mamba-cache-size", "32"), kvcached_env=_MAMBA),
    Model("llama3.2-1b", "Llama-3.2-1B-shaped MHA: 16 layers, 8 KV heads x 64, bf16", "mha", _LLAMA32_1B),
    Model("llama3-8b", "Llama-3-8B-shaped MHA: 32 layers, 8 KV heads x 128, bf16", "mha",
          bench_server.SHAPES["llama3-8b"].config),
    # the named model's attention (or state) geometry with narrower MLPs, so that every
    # variant's servers of the mix fit one GPU side by side: the KV path is what is measured
    Model("deepseek-v2-lite-slim", "DeepSeek-V2-Lite's MLA (27 layers, 512 + 64 bf16), dense MLPs of 2816",
          "mla", {**bench_server.SHAPES["deepseek-v2-lite"].config, "intermediate_size": 2816}, page_size=1),
    Model("qwen3.5-4b-slim", "Qwen3.5-4B's hybrid (8 full-attention layers of 4 KV heads x 256, 24 gated "
          "delta-net layers), MLPs of 3072", "mamba", {**bench_server.SHAPES["qwen3.5-4b"].config,
                                                      "intermediate_size": 3072},
          flags=("--max-mamba-cache-size", "32"), kvcached_env=_MAMBA),
)}


def labels(names) -> list[str]:
    """One label per model slot: its name, or name-1, name-2, ... where a name repeats."""
    names = list(names)
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(f"{n}-{seen[n]}" if names.count(n) > 1 else n)
    return out


# ---- variants ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    name: str
    letter: str
    tree: str          # "pristine" (SGLang 0.5.20 as released) or "patched" (the series)
    kvcached: bool
    hicache: bool
    what: str


VARIANTS = {v.name: v for v in (
    Variant("static", "a", "pristine", False, False, "static split, native SGLang, HiCache off"),
    Variant("static-hicache", "b", "pristine", False, True, "static split, native HiCache"),
    Variant("kvcached", "c", "pristine", True, False, "kvcached on SGLang as released, HiCache off"),
    Variant("kvcached-hicache", "d", "patched", True, True, "kvcached with the series and HiCache (the product)"),
)}
BASELINE = "static-hicache"      # (b): every ratio divides by it; its servers give the reference answers
PRODUCT = "kvcached-hicache"     # (d): judged against the targets; its answers checked on the sample
PHASES = ("bursts", "waves", "even")
SHIFTING = ("bursts", "waves")


# ---- the plan ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """Everything a run does, the same for every variant. Rates are requests/s per model;
    sizes are tokens unless named otherwise."""
    models: tuple[str, ...]
    variants: tuple[str, ...] = tuple(VARIANTS)
    rounds: int = 2
    phases: tuple[str, ...] = PHASES
    even_rounds: int = 1              # the even-load control runs in the first rounds only
    phase_s: float = 30.0             # arrivals of each phase last this long
    drain_s: float = 60.0             # then its last answers are awaited this long at most ("cut")
    windows: int = 4                  # bursts: windows a phase, the models in turn
    wave_cycles: float = 1.0          # waves: up-and-down cycles of each model a phase
    burst_rate: float = 16.0          # bursts: the model whose window it is
    idle_rate: float = 1.0            # bursts: the others; waves: a wave's trough
    wave_rate: float = 16.0           # waves: a wave's crest
    even_rate: float = 6.0            # even: every model all the time
    kv_budget_gib: float = 4.0        # GPU memory for KV of a whole variant (every model's)
    host_gb: float = 8.0              # --hicache-size of every server with HiCache (SGLang's GB)
    cached_fraction: float = 0.5      # kvcached: KVCACHED_MAX_CACHED_TOKENS = this x the static share
    gpu_utilization: float = 0.95     # KVCACHED_GPU_UTILIZATION: kvcached maps none of the rest
    kvcached_layout: str = "contiguous"
    groups: int = 12                  # shared system prefixes a model
    prefix_tokens: int = 4096
    conversations: int = 4            # conversations on each prefix
    turns: int = 4
    user_tokens: int = 192
    reply_tokens: int = 64            # the fixed reply a later turn carries (not the model's answer)
    max_new_tokens: int = 32
    sample_groups: int = 12           # the correctness sample: prefixes, each asked ...
    sample_prefix_tokens: int = 4096
    sample_questions: int = 2         # ... this many questions, the prefixes in turn
    sample_question_tokens: int = 64
    sample_new_tokens: int = 16
    slo_ms: float = 1000.0            # TTFT objective
    warmup_s: float = 10.0            # even load on each variant after its servers start, not measured
    seed: int = 1
    mem_fraction_static: float = 0.85
    fleet: str = "all"                # "all": every variant's servers up at once; "variant": one variant's
    request_timeout_s: float = 300.0
    server_flags: tuple[str, ...] = ("--sleep-on-idle",)

    @property
    def budget_bytes(self) -> int:
        return int(self.kv_budget_gib * GIB)

    @property
    def labels(self) -> list[str]:
        return labels(self.models)

    def model(self, label: str) -> Model:
        return MODELS[self.models[self.labels.index(label)]]

    def working_set(self) -> int:
        """Distinct prompt tokens of a model's traffic: the prefixes once, every turn's user
        part, every reply but a conversation's last (which no prompt carries)."""
        return self.groups * self.prefix_tokens + self.groups * self.conversations * (
            self.turns * self.user_tokens + (self.turns - 1) * self.reply_tokens)

    def longest_prompt(self) -> int:
        return max(self.prefix_tokens + self.turns * self.user_tokens + (self.turns - 1) * self.reply_tokens,
                   self.sample_prefix_tokens + self.sample_question_tokens)


SEQUENCES = ("models", "variants", "phases", "server_flags")


def plan_from(base: Plan, overrides: dict) -> Plan:
    """`base` with fields replaced (lists become tuples); ValueError naming an unknown field
    or a value of the wrong type."""
    known = {f.name: f for f in fields(Plan)}
    changes = {}
    for key, value in overrides.items():
        if key not in known:
            raise ValueError(f"no plan field {key!r} (fields: {', '.join(known)})")
        current = getattr(base, key)
        if key in SEQUENCES:
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"plan field {key!r} takes a list of strings, not {value!r}")
            value = tuple(value)
        elif isinstance(current, bool) or isinstance(value, bool):
            raise ValueError(f"plan field {key!r}: {value!r}")
        elif isinstance(current, (int, float)) and isinstance(value, (int, float)):
            if isinstance(current, int) and not isinstance(value, int):
                raise ValueError(f"plan field {key!r} takes a whole number, not {value!r}")
        elif type(value) is not type(current):
            raise ValueError(f"plan field {key!r} takes {type(current).__name__}, not {value!r}")
        changes[key] = value
    return replace(base, **changes)


PRESETS = {
    # harness/compare's tiny MHA config twice: the whole pipeline on a GPU in minutes
    "smoke": Plan(models=("qwen2-tiny", "qwen2-tiny"), rounds=1, phase_s=8.0, drain_s=30.0, burst_rate=30.0,
                  idle_rate=2.0, wave_rate=30.0, even_rate=10.0, kv_budget_gib=1.0, host_gb=2.0, groups=16,
                  prefix_tokens=1536, conversations=4, turns=3, user_tokens=128, reply_tokens=64,
                  max_new_tokens=16, sample_groups=12, sample_prefix_tokens=1536, warmup_s=3.0),
    # two of one kind, the first case: 32 KB of KV a token, a 4 GiB budget (131,072
    # tokens, a static share of 65,536 each) under a working set of about 98,000 tokens a model
    "two-mha": Plan(models=("llama3.2-1b", "llama3.2-1b")),
    # the same under load that overloads a static share: two-mha left every variant under
    # 140 ms at TTFT p99 on an H100; a 2 GiB budget and 48 requests/s a burst put (a) at 10-18 %
    # of requests within the objective and (b) at 100 % (one round of bursts only:
    # results/2026-12-07-h100-sharing-two-mha-overload-probe.json; the waves' and even rates
    # here are not probed)
    "two-mha-overload": Plan(models=("llama3.2-1b", "llama3.2-1b"), kv_budget_gib=2.0, burst_rate=48.0,
                             idle_rate=2.0, wave_rate=48.0, even_rate=12.0),
    # the three pool kinds the series serves, one of each; every variant's servers up at once
    # need about 85 GiB (an H200; on an H100: fleet "variant", its servers started a slot each)
    "mix": Plan(models=("llama3.2-1b", "deepseek-v2-lite-slim", "qwen3.5-4b-slim"), windows=6,
                kv_budget_gib=8.0, host_gb=12.0, groups=14, even_rate=4.0),
}


# ---- budgets -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Budget:
    """One server's share of the variant's memory."""
    variant: str
    model: str                    # its label
    device_tokens: int            # --max-total-tokens
    kv_bytes: int                 # device KV bytes it can hold alone (tokens and Mamba state)
    host_gb: float | None         # --hicache-size; None: HiCache off
    cached_tokens: int | None     # kvcached: KVCACHED_MAX_CACHED_TOKENS; None: kvcached off


def floor_to(value: float, step: int) -> int:
    return int(value // step) * step


def budgets(plan: Plan) -> dict[tuple[str, str], Budget]:
    """Each (variant, model label)'s budget. Static variants split the KV budget evenly:
    a model's share holds its Mamba state (if any) and --max-total-tokens tokens, whole
    pages. A kvcached server may grow to the whole budget (the other models idle and
    empty): its --max-total-tokens is that; what it really gets is what the shared GPU
    has free (the ballast). HiCache's servers get --hicache-size host_gb each."""
    B, n = plan.budget_bytes, len(plan.models)
    out = {}
    for label, name in zip(plan.labels, plan.models):
        m = MODELS[name]
        static = floor_to((B / n - m.state_bytes) / m.kv_bytes_per_token, m.page_size)
        elastic = floor_to((B - m.state_bytes) / m.kv_bytes_per_token, m.page_size)
        cap = floor_to(plan.cached_fraction * static, m.page_size)
        for v in plan.variants:
            var = VARIANTS[v]
            tokens = elastic if var.kvcached else static
            out[(v, label)] = Budget(v, label, tokens, tokens * m.kv_bytes_per_token + m.state_bytes,
                                     plan.host_gb if var.hicache else None, cap if var.kvcached else None)
    return out


def variant_totals(plan: Plan) -> dict[str, dict]:
    """Per variant: the GPU KV memory its servers share (bytes) and the host memory of its
    HiCache pools (GB). Static: the sum of the shares; kvcached: the budget itself, which
    the ballast leaves free for the servers' pools to grow in."""
    b = budgets(plan)
    out = {}
    for v in plan.variants:
        mine = [b[(v, label)] for label in plan.labels]
        out[v] = {"kv_bytes": plan.budget_bytes if VARIANTS[v].kvcached else sum(x.kv_bytes for x in mine),
                  "host_gb": sum(x.host_gb or 0 for x in mine)}
    return out


def problems(plan: Plan) -> list[str]:
    """Why the plan cannot run as asked (bad input), each in a line; [] when it can."""
    out = []
    unknown = [m for m in plan.models if m not in MODELS]
    if unknown or not plan.models:
        return [f"models: unknown {unknown} (known: {', '.join(MODELS)})" if unknown else "models: none named"]
    if len(plan.models) < 2:
        out.append("models: sharing needs two at least")
    bad = [v for v in plan.variants if v not in VARIANTS]
    if bad or len(set(plan.variants)) != len(plan.variants):
        out.append(f"variants: each once, of {', '.join(VARIANTS)}")
    elif BASELINE not in plan.variants:
        out.append(f"variants: {BASELINE} (b) is the baseline of every ratio and the reference answers")
    bad = [p for p in plan.phases if p not in PHASES]
    if bad or not plan.phases or len(set(plan.phases)) != len(plan.phases):
        out.append(f"phases: each once, of {', '.join(PHASES)}")
    if plan.fleet not in ("all", "variant"):
        out.append("fleet: 'all' or 'variant'")
    if plan.kvcached_layout not in matrix.KVCACHED_LAYOUTS:
        out.append(f"kvcached_layout: one of {', '.join(matrix.KVCACHED_LAYOUTS)}")
    if plan.rounds < 1 or plan.even_rounds < 0:
        out.append("rounds: one at least; even_rounds: not negative")
    if "bursts" in plan.phases and (plan.windows < 1 or plan.windows % len(plan.models)):
        out.append(f"windows: a multiple of the {len(plan.models)} models (each bursts as often)")
    positive = ("phase_s", "kv_budget_gib", "groups", "prefix_tokens", "conversations", "turns", "user_tokens",
                "max_new_tokens", "sample_groups", "sample_prefix_tokens", "sample_questions",
                "sample_question_tokens", "sample_new_tokens", "slo_ms", "request_timeout_s", "wave_cycles")
    out += [f"{k}: must be above 0" for k in positive if getattr(plan, k) <= 0]
    out += [f"{k}: must not be negative" for k in ("drain_s", "warmup_s", "reply_tokens", "burst_rate", "idle_rate",
                                                    "wave_rate", "even_rate", "cached_fraction", "host_gb")
            if getattr(plan, k) < 0]
    if not 0 < plan.gpu_utilization <= 1 or not 0 < plan.mem_fraction_static < 1:
        out.append("gpu_utilization in (0, 1], mem_fraction_static in (0, 1)")
    if any(VARIANTS[v].hicache for v in plan.variants if v in VARIANTS) and plan.host_gb <= 0:
        out.append("host_gb: HiCache's variants need a host pool")
    if out:
        return out
    for (v, label), b in budgets(plan).items():
        m = plan.model(label)
        if b.device_tokens < 2 * m.kvcached_page_tokens:
            out.append(f"kv_budget_gib: {v} {label} gets {b.device_tokens} tokens, under two kvcached pages a "
                       f"layer ({2 * m.kvcached_page_tokens}); a static share as small would make the "
                       "comparison about page rounding")
        if b.device_tokens < plan.longest_prompt() + plan.max_new_tokens:
            out.append(f"kv_budget_gib: {v} {label}'s pool of {b.device_tokens} tokens cannot hold one request "
                       f"of {plan.longest_prompt() + plan.max_new_tokens}")
    for label in plan.labels:
        m = plan.model(label)
        static = floor_to((plan.budget_bytes / len(plan.models) - m.state_bytes) / m.kv_bytes_per_token, m.page_size)
        if plan.working_set() <= static:
            out.append(f"working set: {plan.working_set()} tokens a model, not over {label}'s static share of "
                       f"{static}: evicted prefixes would not matter (raise groups or prefix_tokens)")
        if plan.longest_prompt() + plan.max_new_tokens > m.context:
            out.append(f"prompts: the longest ({plan.longest_prompt()} + {plan.max_new_tokens} new) is over "
                       f"{label}'s context of {m.context}")
    return sorted(set(out), key=out.index)


def notes(plan: Plan) -> list[str]:
    """What may weaken the run without stopping it (the dry run prints them)."""
    out = []
    b = budgets(plan)
    for label in plan.labels:
        m = plan.model(label)
        host_tokens = plan.host_gb * GB / m.kv_bytes_per_token
        if plan.host_gb and host_tokens < plan.working_set():
            out.append(f"{label}: a host pool of {plan.host_gb:g} GB holds about {host_tokens:.0f} tokens, under the "
                       f"working set of {plan.working_set()}: HiCache evicts from host too")
        elastic = max((x.device_tokens for (v, lab), x in b.items() if lab == label and VARIANTS[v].kvcached),
                      default=0)
        if plan.host_gb and host_tokens <= elastic:
            out.append(f"{label}: the host pool ({host_tokens:.0f} tokens) is not larger than the kvcached device "
                       f"pool ({elastic}): SGLang warns and HiCache's reach is reduced")
        cap = next((x.cached_tokens for x in b.values() if x.model == label and x.cached_tokens is not None), None)
        if cap is not None and plan.sample_groups * plan.sample_prefix_tokens <= cap:
            out.append(f"{label}: the sample's prefixes ({plan.sample_groups * plan.sample_prefix_tokens} tokens) fit "
                       f"under KVCACHED_MAX_CACHED_TOKENS={cap}: (d)'s sample may never come back from host")
    return out


# ---- servers -----------------------------------------------------------------------------

def ipc_name(tag: str, variant: str, label: str) -> str:
    """KVCACHED_IPC_NAME: one kvcached instance (and shared-memory namespace) per server."""
    return f"share{tag}_{variant}_{label}".replace(".", "-")


def server_args(plan: Plan, label: str, variant: str, model_path: Path, port: int, extra=()) -> list[str]:
    """`sglang.launch_server` arguments: within a model, the variants differ only in
    --max-total-tokens and HiCache."""
    m, b = plan.model(label), budgets(plan)[(variant, label)]
    args = ["--model-path", str(model_path), "--host", "127.0.0.1", "--port", str(port), "--nccl-port", str(port + 1),
            "--load-format", "dummy", "--skip-tokenizer-init", "--page-size", str(m.page_size),
            "--max-total-tokens", str(b.device_tokens), "--mem-fraction-static", f"{plan.mem_fraction_static:g}",
            *m.flags, *plan.server_flags]
    if b.host_gb is not None:
        args += ["--enable-hierarchical-cache", "--hicache-size", f"{b.host_gb:g}"]
    return args + list(extra)


def server_env(plan: Plan, label: str, variant: str, ipc: str) -> dict[str, str]:
    """kvcached off, or on in its own instance with the plan's cap, headroom and layout."""
    b = budgets(plan)[(variant, label)]
    if b.cached_tokens is None:
        return {"ENABLE_KVCACHED": "false"}
    return {"ENABLE_KVCACHED": "true", "KVCACHED_IPC_NAME": ipc, "KVCACHED_MAX_CACHED_TOKENS": str(b.cached_tokens),
            "KVCACHED_GPU_UTILIZATION": f"{plan.gpu_utilization:g}",
            "KVCACHED_CONTIGUOUS_LAYOUT": "true" if plan.kvcached_layout == "contiguous" else "false",
            **dict(plan.model(label).kvcached_env)}


def memory_estimate(plan: Plan, gpu_bytes: int, overhead: int = int(1.5 * GIB)) -> dict:
    """About what the GPU must hold with every variant up (fleet "all") or one ("variant"):
    weights and `overhead` (CUDA graphs, activations, the context) a server, the static
    pools, one kvcached budget (only one kvcached variant runs at a time; the other's
    servers are flushed), kvcached's headroom. Rough: the run checks the real pools."""
    per_server = {label: plan.model(label).weight_bytes + overhead for label in plan.labels}
    totals = variant_totals(plan)
    up = plan.variants if plan.fleet == "all" else [max(plan.variants, key=lambda v: totals[v]["kv_bytes"])]
    need = sum(per_server.values()) * len(up)
    need += sum(totals[v]["kv_bytes"] for v in up if not VARIANTS[v].kvcached)
    if any(VARIANTS[v].kvcached for v in up):
        need += plan.budget_bytes + int(gpu_bytes * (1 - plan.gpu_utilization))
    return {"servers": len(up) * len(plan.labels), "per_server_bytes": per_server, "need_bytes": need,
            "gpu_bytes": gpu_bytes, "fits": need <= gpu_bytes}


def duration_estimate(plan: Plan, start_s: float = 150.0) -> float:
    """About the seconds of a run: the servers' start (once with fleet "all", once a slot
    otherwise), warm-up, the reference, then each slot's phases and (d)'s sample."""
    slots = plan.rounds * len(plan.variants)
    phase = plan.phase_s + min(plan.drain_s, 10.0) + 3
    phases = sum(phase for r in range(plan.rounds) for p in plan.phases if runs_in(plan, p, r))
    sample = len(plan.models) * plan.sample_groups * plan.sample_questions * 0.3
    starts = start_s * (1 if plan.fleet == "all" else slots)
    return starts + len(plan.variants) * plan.warmup_s + sample + len(plan.variants) * phases \
        + plan.rounds * (sample if PRODUCT in plan.variants else 0)


def runs_in(plan: Plan, phase: str, rnd: int) -> bool:
    """Whether a phase runs in round rnd (0-based): the even-load control only in the first
    even_rounds rounds, the others in every round."""
    return phase != "even" or rnd < plan.even_rounds


def as_dict(plan: Plan) -> dict:
    d = asdict(plan)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

