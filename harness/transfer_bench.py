"""HiCache transfer throughput: native SGLang pools vs patched host pools over kvcached.

    python -m harness.transfer_bench --out build/bench/transfer.json    (on a CUDA machine)

Runs one child process per variant (kvcached decides at import time):

  native               SGLang 0.5.20 as released (--native-sglang: its python/ folder)
                       over its own dense pools: the baseline every ratio is taken to;
  patched-dense        the tree on PYTHONPATH (patched) over the same dense pools;
  kvcached-contiguous  the patched tree over kvcached's default layout;
  kvcached-per-layer   the patched tree over kvcached's one-buffer-per-layer layout.

Without --native-sglang, "native" runs the tree on PYTHONPATH too (and says so).
Each child builds the device pool for a model shape, fills it with random data, and
times through SGLang's host pools:

  backup = one backup_from_device_all_layer call (device -> pinned host, all layers)
  load   = load_to_device_per_layer for every layer (host -> device)

with CUDA events after warm-up (JIT compilation outside the timing), the median of
--reps repetitions, random non-contiguous pages, rotating index sets. It also times a
large pinned<->device copy, the link's practical limit. Prints a table last and writes
JSON; harness/plot.py draws it; `python -m harness.results add transfer` summarizes it.

--rounds N runs the variants N times in alternating order and tables each cell's median.
With --cell-by-cell the children stay up, one per variant, and the parent asks them for
one cell at a time: all rounds of all variants of a cell, then the next cell, so a cell's
variants are timed seconds apart instead of one whole run after another.
--table FILES pools saved runs measured alike: each cell's median over all their rounds,
then native's GPU time over each variant's round by round, with a sign test naming the
cells a variant lost in more sets of processes than chance allows.
--tokens 64,16384 times those batches only (each pool sized for the largest), so that a
few cells can be repeated in many sets of processes.

MTP drafts (--parts mtp-mha,mtp-mla; not in the default run): the target's pool plus one
one-layer draft pool packed into the target's host pool (mtp_draft_device_pools), as
SGLang serves EAGLE with a NextN draft: a backup copies all target and draft layers in
one call; a load runs every target layer, then the draft's (is_draft=True). Native is
SGLang's own packed path over its dense pools.

kvcached 0.1.6 builds every MLA pool in the group of the process's first MHA pool, where
a second pool takes over the first's tensors (harness/kvcached_groups.py):
a draft pool frees the target's memory, and in the per-layer layout the MLA part's pool,
built after the MHA part's, gets the MHA pool's tensors. Every kvcached MLA pool here is
built in a group of its own.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time

from harness.kvcached_groups import own_kvcached_group
from harness.models import DEEPSEEK_V2_LITE, QWEN25_7B, QWEN35_4B
from harness.project import ROOT

MODES = {
    "native": {"ENABLE_KVCACHED": "false"},
    "patched-dense": {"ENABLE_KVCACHED": "false"},
    "kvcached-contiguous": {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "true"},
    "kvcached-per-layer": {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "false"},
    # Not in the default run: SGLang's pool with its buffers swapped for views of one
    # torch allocation in kvcached's contiguous geometry (all layers, and K with V,
    # interleaved per token). Separates the cost of the strided access pattern from that
    # of kvcached's memory mapping (docs/harness.md).
    "torch-interleaved": {"ENABLE_KVCACHED": "false"},
}
PAGE = 64
HOST_LAYOUTS = ("layer_first", "page_first")
TOKENS = [64, 256, 1024, 4096, 16384, 65536]
MTP_TOKENS = [4096, 16384, 65536]
KV_PARTS = ("mha", "mla", "mtp-mha", "mtp-mla")
SLOTS = [1, 4, 16, 64, 256]


def cuda_times(fn, reps, warmup=3):
    """Seconds per call, one per repetition, after warm-up (JIT compiled by then)."""
    import torch
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def timed_row(nbytes, times, kernel_us=None, **fields):
    """A result row: GB/s of the median repetition, and of the slowest and fastest;
    kernel_us: the GPU kernels' own time (kernel_profile), where measured."""
    return dict(fields, batch_bytes=nbytes, seconds=statistics.median(times),
                GBps=nbytes / statistics.median(times) / 1e9,
                GBps_min=nbytes / max(times) / 1e9, GBps_max=nbytes / min(times) / 1e9,
                **({} if kernel_us is None else {"kernel_us": kernel_us}))


def kernel_profile(fn, reps):
    """Per run of fn: microseconds the GPU spent in its kernels and copies (summed) and
    from the first start to the last end, the kernels' count and grid sizes (CUPTI)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    per_rep = []
    for i in range(reps):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(i)
            torch.cuda.synchronize()
        with tempfile.NamedTemporaryFile(suffix=".json") as trace:
            prof.export_chrome_trace(trace.name)
            with open(trace.name) as handle:
                events = json.load(handle)["traceEvents"]
        gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        kernels = [e for e in gpu if e["cat"] == "kernel"]
        per_rep.append(dict(
            kernel_us=sum(e["dur"] for e in gpu),
            span_us=(max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)) if gpu else 0.0,
            kernels=len(kernels), copies=len(gpu) - len(kernels),
            blocks=sorted({e.get("args", {}).get("grid", [0])[0] for e in kernels})))
    return per_rep


def timed_op(nbytes, fn, reps, profiles=3, **fields):
    """timed_row for fn: CUDA-event times (after warm-up), then the median GPU time of
    `profiles` profiled runs (what the copies take from the GPU, without the host's share),
    summed over kernels and copies, and (span_us) from the first start to the last end,
    which counts work on two streams at once only once."""
    times = cuda_times(fn, reps)
    profiled = kernel_profile(fn, profiles)
    kernel_us = statistics.median(p["kernel_us"] for p in profiled)
    return timed_row(nbytes, times, kernel_us=kernel_us, span_us=statistics.median(p["span_us"] for p in profiled),
                     **fields)


def load_all_layers(host, pool, host_indices, device_indices, layers, drafts=()):
    """What a load is: every target layer, then each packed draft's layer from its own
    device pool, as SGLang's cache controller issues them."""
    for layer in range(layers):
        host.load_to_device_per_layer(pool, host_indices, device_indices, layer, "kernel")
    for depth, draft in enumerate(drafts):
        host.load_to_device_per_layer(draft, host_indices, device_indices, layers + depth, "kernel", is_draft=True)


def loads_back_exactly(host, pool, views, layers, src, dst, host_backup, host_load, drafts=()) -> bool:
    """Back up device rows `src`, load them into `dst`: dst must then hold src's bytes.

    `src` gets fresh random bytes first: after the timed repetitions (which load backed-up
    rows into the same index sets) it can already hold what a wrong copy reads, and the
    round trip would then reproduce it."""
    import torch

    def as_bytes(t):   # rows as raw bytes: (rows, bytes a row)
        t = t.contiguous()
        return t.view(torch.uint8).reshape(t.shape[0], -1)
    for v in views:
        raw = torch.randint(0, 256, (src.numel(), v[0].numel() * v.element_size()), dtype=torch.uint8,
                            device=v.device)
        v[src] = raw.view(v.dtype).reshape(src.numel(), *v.shape[1:])
    before = [v[src].clone() for v in views]
    host.backup_from_device_all_layer(pool, host_backup, src, "kernel")
    load_all_layers(host, pool, host_load, dst, layers, drafts)
    torch.cuda.synchronize()
    return all(torch.equal(as_bytes(v[dst]), as_bytes(b)) for v, b in zip(views, before))


def series_applied(site: str) -> str:
    """What scripts/status says of the tree this child imports: its first line, then any
    files it finds missing, edited outside the series' changes, or left by a patch tool."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "status"), site],
                          capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if not lines:
        return proc.stderr.strip()[-200:]
    notes = [line for line in lines[1:] if line.startswith(("missing:", "local edits", "foreign:"))]
    return "; ".join(lines[:1] + notes)


def import_sglang(mode: str):
    """Import SGLang as `mode` needs it: kvcached autopatched or not, single-rank stubs."""
    os.environ.update(MODES[mode])
    os.environ.setdefault("KVCACHED_PAGE_SIZE_MB", "4")
    if mode.startswith("kvcached"):
        os.environ["KVCACHED_AUTOPATCH"] = "1"
        import kvcached.integration.sglang.autopatch  # noqa: F401
    import sglang
    import sglang.srt.distributed as dist
    dist.get_tensor_model_parallel_rank = lambda: 0
    dist.get_tensor_model_parallel_world_size = lambda: 1
    dist.get_pipeline_model_parallel_rank = lambda: 0
    return sglang


def token_sets(gen, total_pages, n_tokens, count=4, skip=1, runs=False):
    """`count` sets of n_tokens tokens, each on random distinct pages from `skip` up; with
    `runs`, on one run of consecutive pages from a random start instead (how SGLang's host
    allocator hands out pages: free slots in order)."""
    import torch
    sets, n_pages = [], n_tokens // PAGE
    for _ in range(count):
        if runs:
            start = int(torch.randint(skip, total_pages - n_pages + 1, (1,), generator=gen))
            pages = torch.arange(start, start + n_pages)
        else:
            pages = torch.randperm(total_pages - skip, generator=gen)[:n_pages] + skip
        sets.append((pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1))
    return sets


def required_series_state(mode: str) -> str:
    """What scripts/status must say of the tree a variant times: native is SGLang 0.5.20
    without the series (the oracle), every other variant runs with all of it."""
    return "pristine" if mode == "native" else "applied"


def meta_row(mode: str, sglang) -> dict:
    """Which SGLang tree a child imports, and what scripts/status says of it. A tree in
    another state than the variant needs stops the child: a native variant timed on a
    patched tree would compare the series with itself. The state covers the files the
    series touches; status's notes of missing, edited or stray files (series_applied)
    also stop it."""
    status = series_applied(os.path.dirname(os.path.dirname(sglang.__file__)))
    want = required_series_state(mode)
    if not status.endswith(f": series {want}"):
        hint = " (pass a pristine copy's python/ folder as --native-sglang)" if mode == "native" else ""
        raise SystemExit(f"{mode}: needs an SGLang tree with the series {want}{hint}; scripts/status says: {status}")
    return dict(mode=mode, pool="meta", sglang=os.path.dirname(sglang.__file__), series_applied=status)


def link_cells() -> list[tuple]:
    """A large pinned <-> device copy each way, the link's practical limit: cells (row
    fields, bytes, fn, profiled) whose fns keep the two buffers alive."""
    import torch
    nbytes = 1 << 30
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    fields = dict(mode="pinned-copy", pool="link", host_layout="-", batch=nbytes)
    return [(dict(fields, direction="backup"), nbytes, lambda i: host.copy_(dev, non_blocking=True), False),
            (dict(fields, direction="load"), nbytes, lambda i: dev.copy_(host, non_blocking=True), False)]


def measure(cell, reps: int, profiles: int = 3) -> dict:
    """A cell's row: CUDA-event times, and the GPU time of its copies where `profiled`."""
    fields, nbytes, fn, profiled = cell
    if profiled:
        return timed_op(nbytes, fn, reps, profiles, **fields)
    return timed_row(nbytes, cuda_times(fn, reps), **fields)


def child(mode: str, reps: int, parts: list[str], host_pages: str = "random",
          host_layouts: tuple[str, ...] = HOST_LAYOUTS, profiles: int = 3,
          tokens: list[int] | None = None) -> list[dict]:
    import torch
    sglang = import_sglang(mode)
    rows, gen = [meta_row(mode, sglang)], torch.Generator().manual_seed(0)
    if mode == "native" and "link" in parts:
        rows += [measure(cell, reps) for cell in link_cells()]
    for part in [p for p in KV_PARTS if p in parts]:
        try:
            rows += kv_part(part, mode, reps, gen, host_pages, host_layouts, profiles, tokens)
        except Exception as exc:  # the pool could not be built: the other parts still run
            rows.append(dict(mode=mode, pool=kv_part_shape(part)[3], error=f"{type(exc).__name__}: {exc}"[:300]))
            torch.cuda.empty_cache()
    if "mamba" in parts:
        rows += mamba_part(mode, reps, gen)
    return rows


def token_list(text: str) -> list[int]:
    """--tokens: batch sizes, comma-separated, each a positive multiple of the page."""
    try:
        tokens = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated whole numbers") from None
    bad = [t for t in tokens if t <= 0 or t % PAGE]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{','.join(map(str, bad))}: not a positive multiple of the page ({PAGE} tokens)")
    return tokens


def cell_key(fields: dict) -> tuple:
    """What names a cell between a --serve child and its parent (JSON keeps it as a list)."""
    return (fields["pool"], fields["direction"], fields["host_layout"], fields["batch"])


def serve(mode: str, reps: int, parts: list[str], host_pages: str, host_layouts: tuple[str, ...],
          requests, reply, profiles: int = 3, tokens: list[int] | None = None) -> None:
    """--cell-by-cell's child: build every part's pools and host pools once and keep them,
    check each pool's bytes, reply with its rows so far (meta, byte checks, errors) and the
    cells it can time, then serve requests (serve_requests)."""
    import torch
    sglang = import_sglang(mode)
    rows, cells, checks, gen = [meta_row(mode, sglang)], [], [], torch.Generator().manual_seed(0)
    if mode == "native" and "link" in parts:
        cells += link_cells()
    for part in [p for p in KV_PARTS if p in parts]:
        kind, drafts, batches, label = kv_part_shape(part, tokens)
        try:
            kv = KVBench(kind, gen, max_tokens=max(batches), drafts=drafts)
            for layout in host_layouts:
                layout_cells, check = kv_layout_cells(kv, kv.host_pool(layout), layout, batches, drafts, mode, label,
                                                      host_pages)
                cells += layout_cells
                checks.append(check)
                rows.append(check())
        except Exception as exc:  # the pool could not be built: the other parts still run
            rows.append(dict(mode=mode, pool=label, error=f"{type(exc).__name__}: {exc}"[:300]))
            torch.cuda.empty_cache()
    serve_requests({cell_key(c[0]): c for c in cells}, reps, rows, requests, reply, profiles, checks)


def reply_channel():
    """reply(obj): one JSON line on the process's stdout, which from now on is the replies'
    alone: whatever else the process prints (SGLang, kvcached) goes to its stderr."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout.flush()   # what was printed before goes to stderr too

    def reply(obj):
        replies.write(json.dumps(obj) + "\n")
        replies.flush()
    return reply


def serve_requests(cells: dict, reps: int, rows: list[dict], requests, reply, profiles: int = 3,
                   checks=()) -> None:
    """Reply with `rows` and the cells' keys, then per request line: a measured row for
    {"cell": key}; for {"finish": true} the byte checks again (every pool is built by then:
    a kvcached pool built later could take over an earlier one's memory) and stop."""
    reply(dict(rows=rows, cells=[list(key) for key in cells]))
    for line in requests:
        request = json.loads(line)
        if request.get("finish"):
            reply(dict(rows=[check() for check in checks]))
            return
        reply(measure(cells[tuple(request["cell"])], reps, profiles))


def pool_pages(max_tokens: int) -> tuple[int, int]:
    """(pages a KVBench pool hands out, the pool's size in tokens) for batches of up to
    max_tokens: a few pages more, and 64 more still, which kvcached keeps back."""
    n_pages = max_tokens // PAGE + 8
    return n_pages, (n_pages + 64) * PAGE


def kv_model(kind: str):
    """The model shape a KV part's pool has (mha: Qwen2.5-7B, mla: DeepSeek-V2-Lite) and the
    bytes a token has in one layer (K and V for MHA)."""
    if kind == "mha":
        return QWEN25_7B, QWEN25_7B.kv_heads * QWEN25_7B.head_dim * 2 * 2
    return DEEPSEEK_V2_LITE, DEEPSEEK_V2_LITE.kv_dim * 2


class KVBench:
    """A device KV pool of one model shape, filled with random rows, and what times it.

    Sized for the largest batch; on kvcached pools the pages come from its allocator
    (so they are mapped), on SGLang's own pools they are pages 1..n. With `drafts`,
    that many one-layer MTP draft pools of the same shape and size, packed into the
    target's host pool; a token has the same index in every pool, so on kvcached the
    pages are those every pool's allocator handed out.
    """

    def __init__(self, part: str, gen, max_tokens: int = max(TOKENS), interleave: bool = False,
                 drafts: int = 0):
        import torch
        from sglang.srt.mem_cache import memory_pool as mp
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
        if interleave and drafts:
            raise ValueError("torch-interleaved pools have no MTP draft variant")
        bf = torch.bfloat16
        self.gen, self.part = gen, part
        n_pages, size = pool_pages(max_tokens)
        s, self.row_bytes = kv_model(part)
        self.host_cls = MHATokenToKVPoolHost if part == "mha" else MLATokenToKVPoolHost
        self.layers = s.layers
        group = contextlib.nullcontext
        if part == "mla" and hasattr(mp, "ElasticMLATokenToKVPool"):  # kvcached's: one group per pool
            group = own_kvcached_group

        def build(layers):
            if part == "mha":
                return mp.MHATokenToKVPool(size=size, page_size=PAGE, dtype=bf, head_num=s.kv_heads,
                                           head_dim=s.head_dim, layer_num=layers, device="cuda",
                                           enable_memory_saver=False)
            with group():
                return mp.MLATokenToKVPool(size=size, page_size=PAGE, dtype=bf, kv_lora_rank=s.kv_lora_rank,
                                           qk_rope_head_dim=s.qk_rope_head_dim, layer_num=layers, device="cuda",
                                           enable_memory_saver=False)

        self.pool = build(s.layers)
        self.drafts = [build(1) for _ in range(drafts)]
        self.views = self._views_of(self.pool)
        if interleave:
            self._interleave_layers()
        self.views += [view for draft in self.drafts for view in self._views_of(draft)]
        if hasattr(self.pool, "kvcached_allocator"):
            pages = None
            for pool in (self.pool, *self.drafts):
                pool.kvcached_allocator._wait_post_init()
                handed_out = set(pool.kvcached_allocator.alloc(n_pages))
                pages = handed_out if pages is None else pages & handed_out
            if len(pages) < max_tokens // PAGE:
                raise RuntimeError(f"only {len(pages)} pages mapped in every pool, {max_tokens // PAGE} needed")
            self.pages = torch.tensor(sorted(pages))
        else:
            self.pages = torch.arange(1, n_pages + 1)
        tokens = (self.pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1).cuda()
        for v in self.views:
            v[tokens] = torch.randn((tokens.numel(), *v.shape[1:]), device="cuda").to(v.dtype)

    def _views_of(self, pool):
        return [*pool.k_buffer, *pool.v_buffer] if self.part == "mha" else list(pool.kv_buffer)

    def _interleave_layers(self):
        """Re-point the pool at per-layer views of one buffer, laid out as kvcached's
        contiguous layout lays them: [token][layer][K, V][row]."""
        import torch
        pool, groups = self.pool, (2 if self.part == "mha" else 1)
        first = self.views[0]
        whole = torch.empty((first.shape[0], self.layers, groups, *first.shape[1:]), dtype=first.dtype,
                            device=first.device)
        per_group = [[whole[:, layer, g] for layer in range(self.layers)] for g in range(groups)]
        if self.part == "mha":
            pool.k_buffer, pool.v_buffer = per_group
            for name in ("k_data_ptrs", "v_data_ptrs", "data_ptrs"):  # kvcached publishes none of them
                if hasattr(pool, name):
                    delattr(pool, name)
        else:
            (pool.kv_buffer,) = per_group
            pool.data_ptrs = torch.tensor([v.data_ptr() for v in pool.kv_buffer], dtype=torch.uint64,
                                          device=first.device)
        self.views = [v for group in per_group for v in group]
        torch.cuda.empty_cache()

    def host_pool(self, layout: str):
        """SGLang's host pool over this pool."""
        return self.host_cls(self.pool, 1.0, 0, PAGE, layout, pin_memory=True, device="cpu",
                             mtp_draft_device_pools=self.drafts)

    def index_sets(self, host, n_tokens: int, host_runs: bool = False):
        """Rotating (device, host-for-backup, host-for-load) index sets of n_tokens each;
        device pages random, host pages random or in runs (token_sets)."""
        dev = [(self.pages[t // PAGE] * PAGE + t % PAGE).cuda()
               for t in token_sets(self.gen, len(self.pages), n_tokens, skip=0)]
        host_sets = token_sets(self.gen, host.size // PAGE, n_tokens, runs=host_runs)
        backup = [h if host.can_use_write_back_jit else h.cuda() for h in host_sets]
        return dev, backup, [h.cuda() for h in host_sets]

    def calls(self, host, n_tokens: int, host_runs: bool = False):
        """backup(i), load(i): the timed operations on the i-th rotating index set; and
        check(): whether a backup loaded back elsewhere reproduces the bytes."""
        dev, host_bk, host_ld = self.index_sets(host, n_tokens, host_runs)
        k = len(dev)

        def backup(i):
            host.backup_from_device_all_layer(self.pool, host_bk[i % k], dev[i % k], "kernel")

        def load(i):
            load_all_layers(host, self.pool, host_ld[i % k], dev[i % k], self.layers, self.drafts)

        def check():
            return loads_back_exactly(host, self.pool, self.views, self.layers,
                                      dev[0], dev[1], host_bk[0], host_ld[0], self.drafts)

        return backup, load, check

    def release(self):
        import torch
        del self.pool, self.drafts, self.views
        torch.cuda.empty_cache()


def kv_part_shape(part, tokens: list[int] | None = None):
    """(pool kind, MTP drafts, batches, row label) of a KV part: mha / mla, the target's
    pool alone; mtp-mha / mtp-mla, with one packed MTP draft. The batches are `tokens`
    where given (--tokens), else the part's own; the pool is sized for the largest."""
    if part.startswith("mtp-"):
        kind = part[len("mtp-"):]
        return kind, 1, tokens or MTP_TOKENS, f"{kind.upper()}+MTP"
    return part, 0, tokens or TOKENS, part.upper()


def kv_layout_cells(kv, host, layout, tokens, drafts, mode, label, host_pages):
    """The cells of one host layout (a backup and a load per batch), and check(): the row
    of a byte-exact load-back check through the same calls at 4096 tokens (the largest
    batch where 4096 is not one)."""
    cells, check, check_at = [], None, 4096 if 4096 in tokens else max(tokens)
    for n in tokens:
        backup, load, batch_check = kv.calls(host, n, host_runs=host_pages == "runs")
        nbytes = n * kv.row_bytes * (kv.layers + drafts)
        fields = dict(mode=mode, pool=label, host_layout=layout, batch=n, host_pages=host_pages)
        cells += [(dict(fields, direction="backup"), nbytes, backup, True),
                  (dict(fields, direction="load"), nbytes, load, True)]
        if n == check_at:  # the timed path must also be the right one
            def check(fields=fields, batch_check=batch_check):
                return dict(fields, byte_exact=batch_check())
    return cells, check


def kv_part(part, mode, reps, gen, host_pages="random", host_layouts=HOST_LAYOUTS, profiles=3, tokens=None):
    kind, drafts, tokens, label = kv_part_shape(part, tokens)
    rows, kv = [], KVBench(kind, gen, max_tokens=max(tokens), drafts=drafts)
    for layout in host_layouts:
        host = kv.host_pool(layout)
        cells, check = kv_layout_cells(kv, host, layout, tokens, drafts, mode, label, host_pages)
        rows += [measure(cell, reps, profiles) for cell in cells]
        rows.append(check())
        host.destroy()
    kv.release()
    return rows


def mamba_part(mode, reps, gen):
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache import memory_pool as mp
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    bf, rows = torch.bfloat16, []
    if True:
        m = QWEN35_4B
        shape = Mamba2StateShape.create(**m.state_shape_kwargs())
        params = Mamba2CacheParams(shape=shape, layers=m.linear_layers,
                                   dtype=Mamba2StateDType(conv=bf, temporal=torch.float32))
        slots = max(SLOTS) + 16  # kvcached keeps a few slots back
        pool = mp.MambaPool(size=slots, spec_state_size=slots, cache_params=params,
                            mamba_layer_ids=list(range(len(m.linear_layers))), device="cuda")
        if hasattr(pool, "kvcached_allocator"):
            pool.kvcached_allocator._wait_post_init()
        # Elastic pools allocate slots themselves; SGLang's own pool leaves that to
        # its HybridReqToTokenPool, so take slots 1..n (0 is the null slot) there.
        used = (pool.alloc(max(SLOTS)) if hasattr(pool, "alloc") else torch.arange(1, max(SLOTS) + 1)).cuda()
        layers = len(m.linear_layers)
        for l in range(layers):
            st = pool.mamba_cache.at_layer_idx(l)
            st.temporal[used] = torch.randn((used.numel(), *st.temporal.shape[1:]), device="cuda")
            st.conv[0][used] = torch.randn((used.numel(), *st.conv[0].shape[1:]), device="cuda").to(bf)
        host = MambaPoolHost(pool, 1.05, 0, pin_memory=True, device="cpu", layout="page_first")
        per_slot = host.size_per_token
        for n in SLOTS:
            dev_sets = [used[torch.randperm(used.numel(), generator=gen)[:n].cuda()] for _ in range(4)]
            host_sets = [torch.randperm(host.size - 1, generator=gen)[:n] + 1 for _ in range(4)]
            host_ld = [h.cuda() for h in host_sets]
            def backup(i):
                host.backup_from_device_all_layer(pool, host_sets[i % 4], dev_sets[i % 4], "kernel")

            def load(i):
                for layer in range(layers):
                    host.load_to_device_per_layer(pool, host_ld[i % 4], dev_sets[i % 4], layer, "kernel")
            for direction, fn in (("backup", backup), ("load", load)):
                rows.append(timed_op(n * per_slot, fn, reps, mode=mode, pool="Mamba", direction=direction,
                                     host_layout="page_first", batch=n))
            if n == 16:
                states = [pool.mamba_cache.at_layer_idx(l) for l in range(layers)]
                views = [s.temporal for s in states] + [c for s in states for c in s.conv]
                ok = loads_back_exactly(host, pool, views, layers, dev_sets[0], dev_sets[1], host_sets[0], host_ld[0])
                rows.append(dict(mode=mode, pool="Mamba", host_layout="page_first", batch=n, byte_exact=ok))
    return rows


def child_env(mode: str, native_sglang: str | None) -> dict:
    """The environment of a child: the native variant imports the pristine tree when one
    is given."""
    env = dict(os.environ)
    if mode == "native" and native_sglang:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [native_sglang, env.get("PYTHONPATH")]))
    return env


CHILD = [sys.executable, "-m", "harness.transfer_bench", "--child"]   # run in ROOT


def run_child(mode: str, native_sglang: str | None, args: list[str]) -> list[dict]:
    """Run `--child mode args` in a fresh process (kvcached patches at import time); the
    native variant imports the pristine tree when one is given. Returns its rows."""
    started = time.time()
    proc = subprocess.run([*CHILD, mode, *args], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(mode, native_sglang))
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"{mode}: benchmark child failed")
    print(f"{mode}: {time.time() - started:.0f} s", file=sys.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


class ServingChild:
    """A `--child mode --serve` process: its variant's pools built once, a cell timed per
    request (serve). Its stderr goes to a file, shown if it fails or falls silent."""

    # One reply is one cell of one variant (seconds), or a child's setup: its pools and
    # their kernels' first compilation (minutes). Past this a child is taken as hung.
    REPLY_TIMEOUT_S = 1200

    def __init__(self, mode: str, native_sglang: str | None, args: list[str]):
        self.mode, self.log = mode, tempfile.TemporaryFile("w+b")
        self.proc = subprocess.Popen([*CHILD, mode, "--serve", *args], text=True, cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env=child_env(mode, native_sglang))

    def receive(self, timeout: float | None = None) -> dict:
        # One reply per request, so nothing waits in the pipe's buffer between them and
        # select() on the pipe tells whether a reply came.
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout or self.REPLY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            silent = not ready   # no reply in time; an end of its output is a child that ended
            if silent:
                self.proc.kill()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:   # it closed its output but lives on
                self.proc.kill()
                self.proc.wait()
            self.log.seek(0)
            print(self.log.read()[-4000:].decode(errors="replace"), file=sys.stderr)
            raise SystemExit(f"{self.mode}: benchmark child "
                             + (f"sent nothing in {timeout or self.REPLY_TIMEOUT_S} s" if silent else
                                f"failed (exit {self.proc.returncode})"))
        return json.loads(line)

    def request(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.receive()

    def ask(self, cell: tuple) -> dict:
        return self.request({"cell": list(cell)})

    def finish(self) -> list[dict]:
        """Its pools' byte checks again, after every cell."""
        return self.request({"finish": True})["rows"]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()   # the end of its requests: it exits
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.log.close()


def cell_by_cell_rows(modes: list[str], rounds: int, start, save=lambda rows: None,
                      first_round: int = 0) -> list[dict]:
    """--cell-by-cell: a serving child per variant (start(mode)), started one after another
    so that each builds its pools and compiles its kernels alone; then, cell by cell, the
    cell's rounds, each round every variant that has the cell, in round_order. A cell's
    variants are timed seconds apart, so a slower stretch of the machine meets them alike,
    where whole-run children leave minutes between them; at the end every child checks its
    pools' bytes again. save(rows) after every cell; rounds are numbered from first_round."""
    children, offered, cells, rows = {}, {}, [], []
    try:
        for mode in modes:
            children[mode] = start(mode)
            hello = children[mode].receive()
            rows += hello["rows"]
            offered[mode] = [tuple(c) for c in hello["cells"]]
            cells += [c for c in offered[mode] if c not in cells]
        for cell in cells:
            having = [m for m in modes if cell in offered[m]]
            rows += [dict(children[mode].ask(cell), round=first_round + round_)
                     for round_, mode in round_order(having, rounds)]
            save(rows)
        for mode in modes:
            rows += children[mode].finish()
    finally:
        for child_ in children.values():
            child_.close()
    return rows


# What must be the same in runs that --table pools: what was measured, on what and how
# it was scheduled. Repetitions and profiled runs per cell say how precisely each round
# was timed, not what: runs that differ in them pool.
POOLED_ALIKE = ("gpu", "torch", "page_size", "host_pages", "cell_by_cell")


def run_setup(meta: dict) -> dict:
    # --cell-by-cell was named --interleave in the first runs that used it
    return {k: meta.get(k, meta.get("interleave") if k == "cell_by_cell" else None) for k in POOLED_ALIKE}


def saved_rows(paths: list[str]) -> list[dict]:
    """--table: the rows of saved runs, pooled (table() takes each cell's median over all
    their rounds). Runs measured differently (POOLED_ALIKE) are not pooled, nor a run with
    a variant whose tree is not on record in the state it needs (a run saved before
    children checked it): a patched native would compare the series with itself, a
    pristine patched variant time SGLang as shipped."""
    rows, first, seen = [], None, set()
    for path in paths:
        if os.path.realpath(path) in seen:   # its rounds would count twice
            raise SystemExit(f"{path}: given twice")
        seen.add(os.path.realpath(path))
        try:
            with open(path) as handle:
                data = json.load(handle)
        except (OSError, ValueError) as exc:   # missing, unreadable, not JSON: one line, not a traceback
            raise SystemExit(f"{path}: cannot read it ({exc})") from None
        if not isinstance(data, dict) or "meta" not in data or "rows" not in data:
            raise SystemExit(f"{path}: not a transfer_bench.py --out file (no meta and rows)")
        setup = run_setup(data["meta"])
        first = first or (path, setup)
        if setup != first[1]:
            differ = ", ".join(f"{k} {first[1][k]} / {setup[k]}" for k in POOLED_ALIKE if setup[k] != first[1][k])
            raise SystemExit(f"{first[0]} and {path} were measured differently ({differ}): pool alike runs only")
        trees = {r["mode"]: str(r.get("series_applied")) for r in data["rows"] if r.get("pool") == "meta"}
        for mode in sorted({r["mode"] for r in data["rows"] if r.get("pool") not in ("meta", "link")}):
            want = required_series_state(mode)
            if not trees.get(mode, "").endswith(f": series {want}"):
                raise SystemExit(f"{path}: its {mode} variant's tree is not on record as {want} "
                                 f"({trees.get(mode, 'no record')}); leave this run out")
        rows += [dict(r, run=path) for r in with_process_sets(data["rows"], data["meta"])]   # rounds pair within their run
    return rows


VARIANTS = ("native", "patched-dense", "kvcached-contiguous", "kvcached-per-layer")
IDENTITY = ("mode", "pool", "direction", "host_layout", "batch")   # what one measurement is of
TIMES = ("GBps", "seconds", "kernel_us", "span_us")


def merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per measurement of a --rounds run: the median of its rounds' GB/s and times,
    with `rounds` saying how many there were; a load-back check passes only if it passed in
    every round. At small batches two processes of one variant can differ by more than the
    variants do (docs/harness.md), so single runs cannot rank them. Rows of a one-round
    run and error rows come back unchanged."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = ("error", len(groups)) if "error" in r else tuple(r.get(k) for k in IDENTITY)
        groups.setdefault(key, []).append(r)
    merged = []
    for same in groups.values():
        if len(same) == 1:
            merged.append(same[0])
            continue
        out = {k: v for k, v in same[0].items() if k not in ("round", "GBps_min", "GBps_max")}
        out["rounds"] = len(same)
        for name in TIMES:
            values = [r[name] for r in same if name in r]
            if values:
                out[name] = statistics.median(values)
        if "seconds" in out and "batch_bytes" in out:   # GB/s of the median time, as timed_row gives it
            out["GBps"] = out["batch_bytes"] / out["seconds"] / 1e9
        if "byte_exact" in out:
            out["byte_exact"] = all(r.get("byte_exact") for r in same)
        merged.append(out)
    return merged


def process_set(meta: dict, round_: int) -> int:
    """Which set of fresh children timed a round: --cell-by-cell keeps one set up for
    --rounds rounds (--process-sets starts the next), a whole run starts fresh children
    every round."""
    cell_by_cell = meta.get("cell_by_cell", meta.get("interleave"))
    return round_ // (meta.get("rounds") or 1) if cell_by_cell else round_


def with_process_sets(rows: list[dict], meta: dict) -> list[dict]:
    """Each timed round's rows, told which set of processes timed them (process_set)."""
    return [dict(r, process_set=process_set(meta, r["round"])) if "round" in r else r for r in rows]


def paired_gpu_ratios(rows: list[dict]) -> dict[tuple, dict[tuple, list[float]]]:
    """(variant, pool, direction, host layout, batch) -> {(run, process set): native's GPU
    time over the variant's, round by round}. A round times every variant of a cell
    together (seconds apart with --cell-by-cell), so each ratio meets one state of the
    GPU and host, where the table's ratio of medians pairs rounds that ran apart."""
    us = {(r["mode"], *(r[k] for k in IDENTITY[1:]), r.get("run"), r.get("process_set"), r["round"]): r["kernel_us"]
          for r in rows if r.get("kernel_us") and "round" in r}
    ratios: dict[tuple, dict[tuple, list[float]]] = {}
    for (mode, *cell, run, set_, round_), t in us.items():
        native = us.get(("native", *cell, run, set_, round_))
        if mode != "native" and native:
            ratios.setdefault((mode, *cell), {}).setdefault((run, set_), []).append(native / t)
    return ratios


def sign_test(slower: int, faster: int) -> float:
    """One-sided sign test, ties left out: the chance that `slower` or more of
    slower + faster fair coin flips come up slower."""
    n = slower + faster
    return sum(math.comb(n, k) for k in range(slower, n + 1)) / 2 ** n


def round_paired_summary(paired: dict[tuple, dict[tuple, list[float]]]) -> str:
    """The lowest round-paired median, and the cells a variant lost to native in more sets
    of processes than chance would have it. Rounds of one set are not independent (a slow
    process stays slow for minutes), so the test takes each set's median ratio as one
    trial: one-sided sign test, p < 0.05, which needs 5 sets a cell."""
    def name(key):
        return f"{key[0]}, {' '.join(map(str, key[1:]))}"

    def median(key):
        return statistics.median(r for rounds in paired[key].values() for r in rounds)

    def flagged(n):   # the chance that a cell of n untied sets is named when no variant is slower
        return sum(math.comb(n, k) for k in range(n + 1) if sign_test(k, n - k) < 0.05) / 2 ** n
    low = min(paired, key=median)
    slower, sets, by_chance = [], 0, 0.0
    for key in sorted(paired, key=median):
        per_set = [statistics.median(rounds) for rounds in paired[key].values()]
        lost, won = sum(r < 1 for r in per_set), sum(r > 1 for r in per_set)
        sets, by_chance = max(sets, len(per_set)), by_chance + flagged(lost + won)
        if sign_test(lost, won) < 0.05:
            slower.append(f"{name(key)}: {lost} of {len(per_set)} sets, median {median(key):.4f}")
    return (f"lowest round-paired GPU-time ratio to native (median): {median(low):.4f} ({name(low)})\n"
            "slower than native in more sets of processes than chance allows (each set's median, "
            "sign test, p < 0.05): " + ("; ".join(slower) or "none")
            + (f" (of {len(paired)} cells; chance alone would name {by_chance:.1f})" if sets >= 5 else
               f" (the test needs 5 sets of processes a cell; these runs have {sets})"))


def round_order(modes: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, mode) in the order the children run: every other round reversed, so no
    variant always runs first or last, and none always after the same neighbour."""
    return [(r, m) for r in range(rounds) for m in (modes if r % 2 == 0 else modes[::-1])]


def tree_lines(rows: list[dict]) -> list[str]:
    """Each variant's SGLang tree and what scripts/status said of it (its meta row)."""
    return [f"{r['mode']}: {r['sglang']} ({r['series_applied']})" for r in rows if r.get("pool") == "meta"]


SUMMARY_COLUMNS = ("mode", "pool", "direction", "host_layout", "batch", "batch_bytes", "GBps", "kernel_us", "byte_exact",
                   "rounds")


def summary(rows: list[dict]) -> dict:
    """What a committed summary keeps of saved runs (results/): each cell's medians over its
    rounds (merge_rounds), as columns and values, with the trees, the setup and any error;
    table(summary_rows(s)) prints the run's table less the round-paired sign test, which
    needs every round."""
    merged = merge_rounds(rows)
    cells = [r for r in merged if "GBps" in r or "byte_exact" in r]   # timings and load-back checks
    return {"columns": list(SUMMARY_COLUMNS), "values": [[r.get(k) for k in SUMMARY_COLUMNS] for r in cells],
            "trees": [{k: r[k] for k in ("mode", "sglang", "series_applied")} for r in merged if r.get("pool") == "meta"],
            "errors": [{k: r.get(k) for k in ("mode", "pool", "error")} for r in merged if "error" in r]}


def summary_rows(data: dict) -> list[dict]:
    """The rows table() takes, from a summary's data."""
    rows = [{k: v for k, v in zip(data["columns"], values) if v is not None} for values in data["values"]]
    return rows + [dict(t, pool="meta") for t in data["trees"]] + list(data["errors"])


def table(rows: list[dict]) -> str:
    """GB/s per variant, each variant's ratio to native, and each variant's share of the
    link (the pinned copy's GB/s in that direction).

    Ratios are of CUDA-event throughput, then in brackets of the GPU time the copies
    themselves took (native's / the variant's): small batches are bound by the host
    issuing 27-28 per-layer calls, which varies from process to process. Rows of several
    rounds are merged first (merge_rounds)."""
    paired = paired_gpu_ratios(rows)
    rows = all_rows = merge_rounds(rows)
    errors = [f"{r['mode']} {r['pool']}: {r['error']}" for r in rows if "error" in r]
    trees = tree_lines(rows)
    rows = [r for r in rows if "GBps" in r]
    link = {r["direction"]: r["GBps"] for r in rows if r["pool"] == "link"}
    by = {(r["mode"], r["pool"], r["direction"], r["host_layout"], r["batch"]): r["GBps"] for r in rows}
    gpu_us = {(r["mode"], r["pool"], r["direction"], r["host_layout"], r["batch"]): r.get("kernel_us")
              for r in rows}
    keys = sorted({(r["pool"], r["direction"], r["host_layout"], r["batch"]) for r in rows if r["pool"] != "link"})
    short = {"native": "native", "patched-dense": "dense", "kvcached-contiguous": "contig",
             "kvcached-per-layer": "per-layer"}
    head = " | ".join(f"{short[v]} GB/s" for v in VARIANTS)
    ratios = " | ".join(f"{short[v]}/native" for v in VARIANTS[1:])
    shares = " | ".join(f"{short[v]}/link" for v in VARIANTS)
    lines = [f"| pool | dir | host layout | batch | {head} | {ratios} | {shares} |",
             "|---|---|---|---:|" + "---:|" * (3 * len(VARIANTS) - 1)]
    f = lambda x: f"{x:.2f}" if x is not None else "-"
    for key in keys:
        values = [by.get((v, *key)) for v in VARIANTS]
        nat = values[0]
        nat_us = gpu_us.get(("native", *key))

        def rel(variant, x):  # event-time ratio, and GPU-time ratio in brackets
            if x is None or not nat:
                return "-"
            us = gpu_us.get((variant, *key))
            return f"{x / nat:.2f}" + (f" ({nat_us / us:.2f})" if us and nat_us else "")
        rel = [rel(v, x) for v, x in zip(VARIANTS[1:], values[1:])]
        of_link = [f"{x / link[key[1]]:.2f}" if x and key[1] in link else "-" for x in values]
        lines.append(f"| {' | '.join(map(str, key))} | {' | '.join(map(f, values))} | {' | '.join(rel)} "
                     f"| {' | '.join(of_link)} |")
    gpu_ratios = [(gpu_us[("native", *key)] / gpu_us[(v, *key)], v, key) for key in keys for v in VARIANTS[1:]
                  if gpu_us.get(("native", *key)) and gpu_us.get((v, *key))]
    if gpu_ratios:   # the table's two decimals round 0.995 up to 1.00
        low, variant, key = min(gpu_ratios)
        lines.append(f"lowest GPU-time ratio to native: {low:.4f} ({variant}, {' '.join(map(str, key))})")
    if any(sum(map(len, sets.values())) > 1 for sets in paired.values()):
        lines.append(round_paired_summary(paired))
    lines += [f"not measured: {e}" for e in errors]
    checks = [r for r in all_rows if "byte_exact" in r]
    bad = [f"{r['mode']} {r['pool']} {r['host_layout']}" for r in checks if not r["byte_exact"]]
    lines.append(f"byte-exact load-back checks: {len(checks) - len(bad)} of {len(checks)} pass"
                 + (f"; FAILED: {', '.join(bad)}" if bad else ""))
    lines += [f"tree: {t}" for t in trees]
    rounds = sorted({r["rounds"] for r in rows if "rounds" in r})
    if rounds:   # fewer for a cell that a cut-short run left out of its last rounds
        counted = str(rounds[0]) if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}"
        lines.append(f"each cell: the median over its {counted} rounds of the variants in alternating order")
    lines.append(f"\npinned copy (1 GiB): D2H {link['backup']:.1f} GB/s, H2D {link['load']:.1f} GB/s"
                 if {"backup", "load"} <= link.keys() else "\npinned copy: not measured (no link part)")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "build" / "bench" / "transfer.json"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--profiles", type=int, default=3,
                    help="profiled runs per KV cell, whose median GPU time the table's bracketed ratios use")
    ap.add_argument("--parts", default="link,mha,mla,mamba",
                    help=f"any of link,{','.join(KV_PARTS)},mamba (mtp-*: target + one packed MTP draft)")
    ap.add_argument("--modes", default=",".join(VARIANTS), help=f"any of {','.join(MODES)}")
    ap.add_argument("--native-sglang", help="python/ folder of an unpatched SGLang 0.5.20, for the native variant")
    ap.add_argument("--host-pages", choices=("random", "runs"), default="random",
                    help="host pages of a KV batch: random, or one run of consecutive pages (as SGLang's "
                         "host allocator hands them out)")
    ap.add_argument("--host-layouts", default=",".join(HOST_LAYOUTS), help="KV host layouts to time")
    ap.add_argument("--tokens", type=token_list,
                    help=f"the KV parts' batches in tokens, multiples of {PAGE} (default {','.join(map(str, TOKENS))}; "
                         f"mtp-*: {','.join(map(str, MTP_TOKENS))}); each pool is sized for the largest")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the variants this many times, alternating their order (native first, then "
                         "last), and table the median of each cell over the rounds")
    ap.add_argument("--cell-by-cell", action="store_true",
                    help="keep a child per variant running and time each cell in every variant and round "
                         "before the next cell, instead of one variant's whole run after another (KV parts "
                         "and link only)")
    ap.add_argument("--process-sets", type=int, default=1,
                    help="with --cell-by-cell: run its rounds in this many sets of fresh children, one after "
                         "another, so that a slow process is one of several per variant")
    ap.add_argument("--table", nargs="+", metavar="RESULTS",
                    help="print the table of saved --out files instead of measuring; several runs are pooled, each "
                         "cell's median taken over all their rounds")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.table:
        print(table(saved_rows(args.table)))
        return
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - {"link", *KV_PARTS, "mamba"})
    if unknown:
        ap.error(f"--parts: unknown {','.join(unknown)} (any of link,{','.join(KV_PARTS)},mamba)")
    host_layouts = tuple(args.host_layouts.split(","))
    if set(host_layouts) - set(HOST_LAYOUTS):
        ap.error(f"--host-layouts: any of {','.join(HOST_LAYOUTS)}")
    if unknown := sorted(set(args.modes.split(",")) - set(MODES)):   # else a child fails after others ran
        ap.error(f"--modes: unknown {','.join(unknown)} (any of {','.join(MODES)})")
    if args.reps < 1 or args.rounds < 1 or args.profiles < 1 or args.process_sets < 1:
        ap.error("--reps, --rounds, --profiles, --process-sets: at least 1")
    if args.process_sets > 1 and not args.cell_by_cell:
        ap.error("--process-sets: with --cell-by-cell (whole-run children are fresh every round already)")
    if args.cell_by_cell and "mamba" in parts:
        ap.error("--cell-by-cell: KV parts and link only (the Mamba part runs in whole-run children, over host "
                 "pools of its own)")
    if args.child and args.serve:
        serve(args.child, args.reps, parts, args.host_pages, host_layouts, sys.stdin, reply_channel(), args.profiles,
              args.tokens)
        return
    if args.child:
        json.dump(child(args.child, args.reps, parts, args.host_pages, host_layouts, args.profiles, args.tokens),
                  sys.stdout)
        return
    modes = args.modes.split(",")
    import torch
    if not torch.cuda.is_available():
        ap.error("measuring needs a CUDA GPU and torch sees none (--table reads saved runs on any machine)")
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                reps=args.reps, profiles=args.profiles, page_size=PAGE, host_pages=args.host_pages, rounds=args.rounds,
                cell_by_cell=args.cell_by_cell, process_sets=args.process_sets, tokens=args.tokens)
    child_args = ["--reps", str(args.reps), "--profiles", str(args.profiles), "--parts", args.parts,
                  "--host-pages", args.host_pages, "--host-layouts", args.host_layouts,
                  *(["--tokens", ",".join(map(str, args.tokens))] if args.tokens else [])]

    def save(rows):   # as it goes: a cut-short run keeps what it measured
        with open(args.out, "w") as handle:
            json.dump({"meta": meta, "rows": rows}, handle, indent=1)
    if args.cell_by_cell:
        rows = []
        for first_round in range(0, args.process_sets * args.rounds, args.rounds):
            rows += cell_by_cell_rows(modes, args.rounds,
                                      lambda mode: ServingChild(mode, args.native_sglang, child_args),
                                      lambda set_rows: save(rows + set_rows), first_round)
    else:
        rows = []
        for round_, mode in round_order(modes, args.rounds):
            child_rows = run_child(mode, args.native_sglang, child_args)
            rows += [dict(r, round=round_) for r in child_rows] if args.rounds > 1 else child_rows
            save(rows)
    save(rows)
    print(table(with_process_sets(rows, meta)))


if __name__ == "__main__":
    main()
