"""HiCache page_first transfers against the pinned-copy link, and what they take from the GPU.

    python3 bench/link_paths.py --out bench/link-paths.json

on a CUDA machine with the patched SGLang importable (on PYTHONPATH): one process, a few
minutes including the JIT builds of SGLang's HiCache kernels (built in parallel first).
`--dry-run` runs the whole driver without a GPU or SGLang on made-up timings: a check of
the script, not a measurement.

SGLang 0.5.20's default host layout, page_first, keeps a token's rows of every layer
together ([token][layer][row]); its device pools keep each layer apart. Shapes: Qwen2.5-7B
(MHA, 28 layers, K and V rows of 1,024 bytes) and DeepSeek-V2-Lite (MLA, 27 layers,
1,152-byte rows), bf16, page size 64, SGLang's dense device pools, random device pages,
four rotating index sets. A row is the median of --reps CUDA-event times after two
warm-ups; GB/s = bytes moved / time; /link = share of a 1 GiB pinned copy in the same
direction.

backup, device -> pinned host:
  sglang staged write-back   the host pool's own backup_from_device_all_layer: a gather
                             kernel into a device staging buffer, 64 pages at a time, then
                             one copy per host page and K/V, or per run of consecutive host
                             pages where the tree merges them (the series' patch 0009), in
                             one cudaMemcpyBatchAsync per chunk where the driver has it;
                             past 64 pages, with patch 0010, 32 at a time in the buffer's
                             two halves on two streams; random or consecutive host pages
  direct all-layer kernel    transfer_hicache_all_layer[_mla]: the GPU writes the pinned
                             pages itself through the host pool's per-layer page_first
                             tables; block quota 2 (SGLang's), 4, 8
  copy engine alone          the staged path's copies without its gather: from a device
                             buffer in the staging layout, one copy per page (random or
                             consecutive host pages) or one per run of consecutive pages
load, pinned host -> device:
  sglang load_to_device_per_layer, every layer
  direct per-layer kernel    transfer_hicache_one_layer[_mla] per layer; block quota x
                             unroll (SGLang's default and twice it)
  the same, dense source     a reference, not a HiCache layout: the kernel reads each layer's
                             rows in token order from a dense pinned [layer][token][row]
                             buffer, so every read is contiguous: what SMs reading pinned
                             host memory reach without page_first's 28-31 KB token stride
  copy engine alone          what a per-layer load could hand the copy engine: for each
                             layer and tensor one strided copy (cudaMemcpy2DAsync) per run
                             of consecutive host pages, a row (1-1.1 KB) per token, into a
                             dense device buffer (the scatter to the pool's pages not done)
  split                      the per-layer kernel for a layer's first tokens and, on a
                             second stream at the same time, the copy engine's strided
                             copies for the last 25%, 37.5% or 50% (whole pages, host
                             pages in one run) into a dense device buffer, scattered to
                             their device pages by torch's index_copy_: whether SMs and
                             copy engine together move more than either alone
footprint (16,384 tokens): a bf16 8192x8192 GEMM loop on a stream of its own, timed alone
  and while one transfer runs on another stream: the GEMM's slowdown, the share of its
  time the transfer took, and the transfer's GB/s beside it; --footprint-repeats times,
  the paths taking turns, so that the rows show their spread.

Each row gives the launch grid (blocks x threads) and its kernels and copies: how many SMs
a path holds. After its timing a path runs once more on a poisoned destination (fresh
random source bytes for loads), and the destination is compared byte for byte with the
source ("bytes ok"; up to 8,192 tokens, two of the staged path's chunks).

Rows are timed one after another, each batch size's paths in a fixed order, backups
first (--reverse: the other way round; the footprint rows keep theirs). They are written
to --out as they come, so a run cut short keeps what it measured, and printed in that
order; no row starts after --deadline seconds. The tables are printed last.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.transfer_bench import (  # noqa: E402
    PAGE,
    cuda_times,
    import_sglang,
    load_all_layers,
    series_applied,
    timed_row,
    token_sets,
)
from tests.support.models import DEEPSEEK_V2_LITE, QWEN25_7B  # noqa: E402

TOKENS = (1024, 4096, 16384, 65536)
COPY_TOKENS = (16384, 65536)  # the copy engine alone: large batches only
# The split load: shares of its tokens for the copy engine. Alone, the copy engine moves
# 1 KB rows at about 0.70 of the link and SMs reading pinned host memory 0.90-0.93: if
# the two are bounded by their own engines rather than by the link, together they
# could reach it, the copy engine taking up to about 0.43 of the bytes.
COPY_SHARES = (0.25, 0.375, 0.5)
FOOTPRINT_TOKENS = 16384
QUOTAS = (2, 4, 8)
PARTS = ("mha", "mla")
# A lane of the HiCache kernels moves a 4-, 8- or 16-byte package of every 128 bytes,
# 128 / (32 / unroll) (hicache.cuh: get_mem_package, load_vec): unrolls 1, 2, 4 compile.
KERNEL_UNROLLS = (1, 2, 4)
# Byte checks move at most this many tokens: two of the staged write-back's 64-page chunks.
CHECK_TOKENS = 8192
RELAYOUT_THREADS = 256  # relayout.cuh: kRelayoutBlockSize
WARMUP = 2
LINK_BYTES = 1 << 30
GEMM_N = 8192
# The GEMM loop lasts this many times the transfer alone (plus two GEMMs), so that the
# transfer runs beside GEMMs from start to end even when the GEMM slows it down.
GEMM_COVER = 1.5
NOT_STARTED = "not started: past --deadline"
# Where pools and copies live; the CPU smoke test runs the same code on "cpu" over
# emulated kernels (tests/support/emulators.py).
DEVICE = "cuda"


@dataclass(frozen=True)
class Geometry:
    part: str
    label: str
    layers: int
    element_size: int  # bytes of one layer's row of one tensor: K, V, or MLA's KV
    tensors: int  # 2 for MHA (K and V), 1 for MLA

    @property
    def token_bytes(self) -> int:
        return self.layers * self.element_size * self.tensors


GEOMETRIES = {
    "mha": Geometry("mha", "MHA", QWEN25_7B.layers, QWEN25_7B.kv_heads * QWEN25_7B.head_dim * 2, 2),
    "mla": Geometry("mla", "MLA", DEEPSEEK_V2_LITE.layers, DEEPSEEK_V2_LITE.kv_dim * 2, 1),
}


@dataclass(frozen=True)
class KernelFacts:
    """What SGLang's HiCache kernel wrappers choose, read from the tree that runs."""

    threads: int  # per block, of the per-layer and all-layer kernels
    staging_pages: int  # pages per chunk of the staged write-back
    default_quota: int
    default_unroll: Callable[[int], int]  # element size -> unroll
    batch_unroll: Callable[[int, int, int], int]  # (element size, tokens, quota) -> a load's unroll
    pool_unrolls: Callable[[int], list]  # element size -> unrolls a host pool builds at start-up
    staged_merges_runs: bool  # the staged write-back copies runs of consecutive host pages at once
    staged_overlaps: bool  # past one chunk, it alternates staging halves on two streams (patch 0010)


def sglang_kernel_facts() -> KernelFacts:
    from sglang.kernels.ops.kvcache import hicache as hc
    from sglang.srt.mem_cache.pool_host import base

    return KernelFacts(
        threads=getattr(hc, "_BLOCK_SIZE", 1024),
        staging_pages=base._WRITE_BACK_STAGING_PAGE_CHUNK,
        default_quota=hc.DEFAULT_BLOCK_QUOTA,
        default_unroll=hc._default_unroll,
        batch_unroll=getattr(hc, "_unroll_for_batch", lambda size, tokens, quota: hc._default_unroll(size)),
        pool_unrolls=getattr(hc, "_batch_unrolls", lambda size: [hc._default_unroll(size)]),
        staged_merges_runs=staged_merges_runs(),
        staged_overlaps=hasattr(hc, "_staged_write_back_launches"),
    )


def staged_merges_runs() -> bool:
    """Whether the staged write-back the JIT compiles copies a run of consecutive host
    pages at once (staged_write_back.cuh: consecutive_host_pages, patch 0009) or
    each page on its own (SGLang 0.5.20): the rows' copy counts follow it."""
    from sglang.kernels.jit.utils import KERNEL_PATH
    source = KERNEL_PATH / "csrc" / "kvcacheio" / "staged_write_back.cuh"
    return "consecutive_host_pages" in source.read_text()


# --dry-run: the values SGLang's hicache.py and pool_host/base.py set for these shapes.
DRY_FACTS = KernelFacts(threads=1024, staging_pages=64, default_quota=2, default_unroll=lambda size: 2,
                        batch_unroll=lambda size, tokens, quota: 2, pool_unrolls=lambda size: [2],
                        staged_merges_runs=True, staged_overlaps=True)


def load_unrolls(facts: KernelFacts, element_size: int) -> list[int]:
    """SGLang's default unroll, and twice it where the kernel compiles it."""
    default = facts.default_unroll(element_size)
    return [u for u in (default, 2 * default) if u in KERNEL_UNROLLS]


# ---------------------------------------------------------------------------------------
# What is measured: paths, their launch shapes, and the index sets they run on


@dataclass(frozen=True)
class Spec:
    direction: str  # "backup" (device -> host) or "load" (host -> device)
    kind: str  # "staged", "direct", "copies", "sglang" or "split" (loads: kernel and copy engine)
    host_pages: str = "random"  # "consecutive": one run of host pages from page 1; "dense": loads
    # from a dense pinned [layer][token][row] buffer instead of the host pool (a reference)
    quota: int | None = None
    unroll: int | None = None
    coalesce: bool = False  # copies: one copy per run of consecutive host pages
    one_stream: bool = False  # staged: every launch on one stream, as before patch 0010
    copy_share: float | None = None  # split: the share of a load's tokens the copy engine moves

    @property
    def name(self) -> str:
        if self.kind == "staged":
            return f"sglang staged write-back, {self.host_pages} host pages" + (
                ", one stream" if self.one_stream else "")
        if self.kind == "sglang":
            return "sglang load_to_device_per_layer"
        if self.kind == "copies" and self.direction == "load":
            return f"copy engine alone, one strided copy per layer and run, {self.host_pages} host pages"
        if self.kind == "copies":
            how = "one copy per run" if self.coalesce else "one copy per page"
            return f"copy engine alone, {how}, {self.host_pages} host pages"
        if self.kind == "split":
            return (f"split per-layer load, kernel bq={self.quota} u={self.unroll} + copy engine for "
                    f"{self.copy_share:.1%} of the tokens, two streams, {self.host_pages} host pages")
        span = "all-layer" if self.direction == "backup" else "per-layer"
        source = ", dense pinned source" if self.host_pages == "dense" else ""
        return f"direct {span} kernel bq={self.quota} u={self.unroll}{source}"


def path_specs(tokens: int, quotas, unrolls, staged_overlaps: bool = False) -> list[Spec]:
    """Every path timed at `tokens`; where the tree's staged write-back overlaps
    (patch 0010), it is timed on one stream as well."""
    default = unrolls[0]
    specs = [Spec("backup", "staged", "random"), Spec("backup", "staged", "consecutive")]
    if staged_overlaps:
        specs += [Spec("backup", "staged", "random", one_stream=True),
                  Spec("backup", "staged", "consecutive", one_stream=True)]
    specs += [Spec("backup", "direct", quota=q, unroll=default) for q in quotas]
    if tokens in COPY_TOKENS:
        specs += [Spec("backup", "copies", "random"), Spec("backup", "copies", "consecutive"),
                  Spec("backup", "copies", "consecutive", coalesce=True)]
    specs.append(Spec("load", "sglang"))
    specs += [Spec("load", "direct", quota=q, unroll=u) for u in unrolls for q in quotas]
    if tokens in COPY_TOKENS:
        specs.append(Spec("load", "copies", "consecutive", coalesce=True))
        specs += [Spec("load", "direct", "dense", quota=q, unroll=default) for q in quotas]
        specs += [Spec("load", "split", "consecutive", quota=quotas[0], unroll=default, copy_share=share)
                  for share in COPY_SHARES]
    return specs


def footprint_specs(default_unroll: int, quotas, staged_overlaps: bool = False) -> list[Spec]:
    wanted = [Spec("backup", "staged", "random"),
              Spec("backup", "staged", "consecutive")]
    if staged_overlaps:
        wanted.append(Spec("backup", "staged", "consecutive", one_stream=True))
    wanted += [Spec("backup", "direct", quota=2, unroll=default_unroll),
               Spec("backup", "direct", quota=4, unroll=default_unroll),
               Spec("load", "sglang"),
               Spec("load", "direct", quota=4, unroll=default_unroll)]
    return [s for s in wanted if s.quota is None or s.quota in quotas]


def footprint_tokens(tokens) -> int:
    return FOOTPRINT_TOKENS if FOOTPRINT_TOKENS in tokens else max(tokens)


def launch_shape(spec: Spec, geom: Geometry, tokens: int, facts: KernelFacts, host_tokens=None) -> dict:
    """Grid of one launch (blocks x threads), kernels and copies of one operation
    (`host_tokens`: the host side of one of its index sets, for the staged path's copies).

    The HiCache kernels launch min(div_ceil(length, workers per block), block quota)
    blocks of `threads`, with 32 / unroll lanes per worker (hicache.cuh: run_one,
    run_all); the staged path's gather launches total_vecs / 256 blocks of 256 per
    chunk, a 16-byte vector per thread (relayout.cuh)."""
    pages = tokens // PAGE
    if spec.kind == "staged":
        launch_pages = staged_launch_pages(facts, pages, overlap=not spec.one_stream)
        vecs = min(pages, launch_pages) * PAGE * geom.layers * (geom.element_size // 16)
        return dict(grid=f"{-(-vecs // RELAYOUT_THREADS)}x{RELAYOUT_THREADS}",
                    kernels=-(-pages // launch_pages), copies=geom.tensors * staged_copies(
                        host_tokens, pages, launch_pages if facts.staged_merges_runs else None))
    if spec.kind == "copies":
        runs = len(page_runs(host_tokens, True)) if host_tokens is not None and spec.coalesce else (
            1 if spec.coalesce else pages)
        per_layer = geom.layers if spec.direction == "load" else 1
        return dict(grid="copy engine", kernels=0, copies=geom.tensors * per_layer * runs)
    quota, unroll = spec.quota, spec.unroll
    if spec.kind == "split":
        copied = copy_engine_tokens(tokens, spec.copy_share)
        runs = len(page_runs(host_tokens[tokens - copied:], True)) if host_tokens is not None else 1
        blocks = min(-(-(tokens - copied) // (facts.threads * unroll // 32)), quota)
        return dict(grid=f"{blocks}x{facts.threads} + copy engine", kernels=geom.layers * (1 + geom.tensors),
                    copies=geom.tensors * geom.layers * runs, quota=quota, unroll=unroll)
    if spec.kind == "sglang":  # SGLang's load picks both itself (hicache.py: _unroll_for_batch)
        quota = facts.default_quota
        unroll = facts.batch_unroll(geom.element_size, tokens, quota)
    blocks = min(-(-tokens // (facts.threads * unroll // 32)), quota)
    return dict(grid=f"{blocks}x{facts.threads}", kernels=1 if spec.direction == "backup" else geom.layers,
                copies=0, quota=quota, unroll=unroll)


@dataclass
class Plan:
    """One index set: device tokens (on the device), host tokens (on the CPU for the
    staged write-back, which reads them to issue its copies; on the device for kernels)."""

    device: object
    host_cpu: object
    host_gpu: object

    def head(self, tokens: int) -> "Plan":
        return Plan(self.device[:tokens], self.host_cpu[:tokens], self.host_gpu[:tokens])


def build_plans(gen, device_pages, host_page_count: int, tokens: int, to_device) -> dict[str, list[Plan]]:
    """Four rotating sets of `tokens` tokens on random device pages, each with random
    host pages ("random") and with the run of host pages from page 1 ("consecutive"; the
    dense source's rows are read in that order too)."""
    import torch
    if tokens // PAGE >= host_page_count:
        raise ValueError(f"{tokens} tokens do not fit the host pool's {host_page_count - 1} usable pages")
    device = [device_pages[t // PAGE] * PAGE + t % PAGE for t in token_sets(gen, len(device_pages), tokens, skip=0)]
    random_host = token_sets(gen, host_page_count, tokens)  # pages 1.., as transfer_bench draws them
    run = torch.arange(PAGE, PAGE + tokens)
    consecutive = [Plan(to_device(d), run, to_device(run)) for d in device]
    return {"random": [Plan(to_device(d), h, to_device(h)) for d, h in zip(device, random_host)],
            "consecutive": consecutive, "dense": consecutive}


def staged_launch_pages(facts: KernelFacts, pages: int, overlap: bool = True) -> int:
    """Pages per launch of the staged write-back: a staging buffer's worth, or half of
    one where it takes more than one buffer and overlaps (patch 0010). The wrapper also
    ends a launch at a host registration piece; these host pools are pinned in one."""
    if overlap and facts.staged_overlaps and pages > facts.staging_pages and facts.staging_pages > 1:
        return facts.staging_pages // 2
    return facts.staging_pages


def on_one_stream(hc, backup) -> Callable[[], None]:
    """The staged write-back as before patch 0010: its launch plan is told it cannot
    overlap, so every launch runs on the current stream through the whole buffer."""
    plan_launches = hc._staged_write_back_launches

    def run():
        hc._staged_write_back_launches = lambda calls, capacity, overlap: plan_launches(calls, capacity, False)
        try:
            backup()
        finally:
            hc._staged_write_back_launches = plan_launches
    return run


def staged_copies(host_tokens, pages: int, chunk_pages: int | None) -> int:
    """Copies per tensor of the staged write-back: one per page, or (chunk_pages given)
    one per run of consecutive host pages within each chunk, as each chunk is one call."""
    if chunk_pages is None or host_tokens is None:
        return pages
    span = chunk_pages * PAGE
    return sum(len(page_runs(host_tokens[start:start + span], True)) for start in range(0, pages * PAGE, span))


def copy_engine_tokens(tokens: int, share: float) -> int:
    """The split load's copy-engine part of `tokens`: `share` of them, rounded to whole
    pages (a run of host pages stays one copy)."""
    return min(round(tokens * share / PAGE) * PAGE, tokens)


def page_runs(host_tokens, coalesce: bool) -> list[tuple[int, int, int]]:
    """(staging token, host token, tokens) of each copy: one per page, or one per run of
    consecutive host pages; staging pages are in index order, as the staged path fills them."""
    runs: list[tuple[int, int, int]] = []
    for i, host in enumerate(host_tokens[::PAGE].tolist()):
        if coalesce and runs and runs[-1][1] + runs[-1][2] == host:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + PAGE)
        else:
            runs.append((i * PAGE, host, PAGE))
    return runs


def split_schedule(layers, copy_engine_part, kernel_part, streams):
    """The split load's order of work: the side stream starts after what the current
    stream has queued, takes each layer's copy-engine part while the current stream takes
    its kernel part, and the current stream ends waiting for the side stream, so that an
    event recorded after the load covers both."""
    main, side = streams.current(), streams.side
    side.wait_stream(main)
    for layer in layers:
        with streams.use(side):
            copy_engine_part(layer)
        kernel_part(layer)
    main.wait_stream(side)


def split_streams(device: str):
    """The split load's streams: two on CUDA, one elsewhere."""
    return CudaStreams() if device == "cuda" else OneStream()


class CudaStreams:
    """The current CUDA stream and one side stream of the split load."""

    def __init__(self):
        import torch
        self.side = torch.cuda.Stream()
        self.current, self.use = torch.cuda.current_stream, torch.cuda.stream


class OneStream:
    """Off CUDA every operation runs in order: both streams are one."""

    class Stream:
        def wait_stream(self, other):
            pass

    def __init__(self):
        self.side = self.Stream()
        self.current, self.use = (lambda: self.side), (lambda stream: contextlib.nullcontext())


# ---------------------------------------------------------------------------------------
# The pools and each path's operation


def sync():
    import torch
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def torch_empty(shape, dtype):
    import torch
    return torch.empty(shape, dtype=dtype, device=DEVICE)


def copy_rows(dst, src):
    """dst <- src, rows of equal width: `src` a pinned host view whose rows lie a fixed
    pitch apart, `dst` dense. On CUDA one cudaMemcpy2DAsync on the current stream (torch's
    copy_ would first gather a strided host source on the CPU); elsewhere torch's copy."""
    if DEVICE != "cuda":
        dst.copy_(src)
        return
    import torch
    width = src[0].numel() * src.element_size()
    assert src[0].is_contiguous() and dst.is_contiguous() and dst.shape == src.shape
    status = cudart().cudaMemcpy2DAsync(
        ctypes.c_void_p(dst.data_ptr()), ctypes.c_size_t(width), ctypes.c_void_p(src.data_ptr()),
        ctypes.c_size_t(src.stride(0) * src.element_size()), ctypes.c_size_t(width),
        ctypes.c_size_t(src.shape[0]), ctypes.c_int(CUDA_MEMCPY_DEFAULT),
        ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
    if status:
        raise RuntimeError(f"cudaMemcpy2DAsync failed: error {status}")


CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)


@functools.cache
def cudart():
    """The CUDA runtime torch has loaded (by its soname: the same library, context and
    streams as torch's)."""
    import torch
    major = torch.version.cuda.split(".")[0]
    try:
        return ctypes.CDLL(f"libcudart.so.{major}")
    except OSError:
        pass
    for folder in sys.path:  # pip's CUDA wheels: nvidia/cu<major>/lib or nvidia/cuda_runtime/lib
        for sub in (f"nvidia/cu{major}/lib", "nvidia/cuda_runtime/lib"):
            path = os.path.join(folder, sub, f"libcudart.so.{major}")
            if os.path.exists(path):
                return ctypes.CDLL(path)
    raise OSError(f"no libcudart.so.{major} found")


def random_bytes(shape, dtype, device):
    import torch
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (shape[0], math.prod(shape[1:]) * itemsize), dtype=torch.uint8, device=device)
    return raw.view(dtype).view(shape)


def same_bytes(a, b) -> bool:
    import torch
    return torch.equal(a.to(b.device).contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class PoolBench:
    """One model shape: SGLang's dense device pool filled with random rows, its
    page_first host pool, each path's operation on a Plan, and the byte checks.

    With dry=True only the index work runs (no SGLang, no device)."""

    def __init__(self, geom: Geometry, max_tokens: int, gen, dry: bool = False):
        import torch
        self.geom, self.gen, self.dry = geom, gen, dry
        self.size = (max_tokens // PAGE + 16) * PAGE  # 16 spare pages, so random pages vary
        self.device_pages = torch.arange(1, self.size // PAGE + 1)  # page 0: padded tokens' writes
        self.stage: dict = {}  # tokens -> backup staging copy; ("load", tokens) -> load buffer;
        # ("dense", tokens) -> dense pinned load source
        if dry:
            self.host_page_count = self.size // PAGE + 1  # SGLang's host pool at ratio 1.0 (base.py)
            return
        from sglang.kernels.ops.kvcache import hicache
        self.hc = hicache
        self.pool = self._device_pool()
        self.host = self._host_pool()
        self.host_page_count = self.host.page_num

    def _device_pool(self):
        import torch
        from sglang.srt.mem_cache import memory_pool as mp
        common = dict(size=self.size, page_size=PAGE, dtype=torch.bfloat16, layer_num=self.geom.layers,
                      device=DEVICE, enable_memory_saver=False)
        if self.geom.part == "mha":
            pool = mp.MHATokenToKVPool(head_num=QWEN25_7B.kv_heads, head_dim=QWEN25_7B.head_dim, **common)
        else:
            pool = mp.MLATokenToKVPool(kv_lora_rank=DEEPSEEK_V2_LITE.kv_lora_rank,
                                       qk_rope_head_dim=DEEPSEEK_V2_LITE.qk_rope_head_dim, **common)
        self.pool = pool
        for layers in self.device_layers():
            for layer in layers:
                layer.normal_()
        return pool

    def _host_pool(self):
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
        cls = MHATokenToKVPoolHost if self.geom.part == "mha" else MLATokenToKVPoolHost
        return cls(self.pool, 1.0, 0, PAGE, "page_first", pin_memory=DEVICE == "cuda", device="cpu")

    def host_tensors(self) -> list:
        """[token][layer][row] host buffers: K and V, or MLA's one."""
        h = self.host
        return [h.k_buffer, h.v_buffer] if self.geom.tensors == 2 else [h.kv_buffer]

    def device_layers(self) -> list[list]:
        p = self.pool
        return [p.k_buffer, p.v_buffer] if self.geom.tensors == 2 else [p.kv_buffer]

    def device_rows(self, tokens) -> list:
        """The device's rows of `tokens` in the host's [token][layer][row] order."""
        import torch
        return [torch.stack([layer[tokens] for layer in layers], dim=1) for layers in self.device_layers()]

    def plans(self, tokens: int) -> dict[str, list[Plan]]:
        move = (lambda t: t) if self.dry else (lambda t: t.to(DEVICE))
        return build_plans(self.gen, self.device_pages, self.host_page_count, tokens, move)

    def operation(self, spec: Spec, tokens: int) -> Callable[[Plan], Callable[[], None]]:
        """prepare(plan) -> the operation on that plan, ready to call (views made once)."""
        if spec.kind == "copies":
            return self._copies(spec, tokens)
        if self.dry:
            return lambda plan: (lambda: None)
        if spec.direction == "load" and spec.kind == "direct":
            return self._direct_load(spec, tokens)
        if spec.kind == "split":
            return self._split_load(spec, tokens)
        build = {("backup", "staged"): self._staged, ("backup", "direct"): self._direct_backup,
                 ("load", "sglang"): self._sglang_load}
        return build[spec.direction, spec.kind](spec)

    def _staged(self, spec):
        host, pool = self.host, self.pool

        def prepare(plan):
            # SGLang's staged write-back takes host indices on the CPU; its fallback
            # (no write-back JIT) takes them on the device.
            host_tokens = plan.host_cpu if host.can_use_write_back_jit else plan.host_gpu
            backup = functools.partial(host.backup_from_device_all_layer, pool, host_tokens, plan.device, "kernel")
            return on_one_stream(self.hc, backup) if spec.one_stream else backup
        return prepare

    def _direct_backup(self, spec):
        # As pool_host/mha.py and mla.py call the all-layer kernel for a page_first host
        # without the staged path (_backup_strided_device_layers): per-layer host tables
        # of the [layer][token] views, host token stride = all layers' rows (layout_dim),
        # device token stride = one row (dense pools: token_stride_size).
        host, pool, hc = self.host, self.pool, self.hc
        common = dict(element_size=self.geom.element_size, unroll=spec.unroll, block_quota=spec.quota)
        if self.geom.part == "mha":
            def prepare(plan):
                return lambda: hc.transfer_hicache_all_layer(
                    k_ptr_dst=host.k_data_ptrs, v_ptr_dst=host.v_data_ptrs, indices_dst=plan.host_gpu,
                    k_ptr_src=pool.k_data_ptrs, v_ptr_src=pool.v_data_ptrs, indices_src=plan.device,
                    kv_cache_src_stride_bytes=host.token_stride_size,
                    kv_cache_dst_stride_bytes=host.layout_dim, **common)
            return prepare

        def prepare_mla(plan):
            return lambda: hc.transfer_hicache_all_layer_mla(
                ptr_dst=host.data_ptrs, indices_dst=plan.host_gpu, ptr_src=pool.data_ptrs,
                indices_src=plan.device, cache_src_stride_bytes=host.token_stride_size,
                cache_dst_stride_bytes=host.layout_dim, **common)
        return prepare_mla

    def _sglang_load(self, spec):
        host, pool, layers = self.host, self.pool, self.geom.layers
        return lambda plan: (lambda: load_all_layers(host, pool, plan.host_gpu, plan.device, layers))

    def _direct_load(self, spec, tokens):
        one_layer, layers = self._one_layer_loads(spec, tokens), range(self.geom.layers)

        def prepare(plan):
            load = one_layer(plan)

            def run():
                for layer in layers:
                    load(layer)
            return run
        return prepare

    def _one_layer_loads(self, spec, tokens):
        # As load_to_device_per_layer calls the one-layer kernel for page_first
        # (pool_host/mha.py, mla.py): the host layer's strided [token][row] view as
        # source, with a chosen unroll and block quota instead of SGLang's; or, for the
        # dense source, that layer's rows of the dense pinned buffer.
        host, pool, hc = self.host, self.pool, self.hc
        tuning = dict(unroll=spec.unroll, block_quota=spec.quota)
        sources = self.dense_source(tokens) if spec.host_pages == "dense" else None
        if self.geom.part == "mha":
            k_src, v_src = sources or (host.k_data_refs, host.v_data_refs)

            def prepare(plan):
                def load(layer):
                    hc.transfer_hicache_one_layer(
                        k_cache_dst=pool.k_buffer[layer], v_cache_dst=pool.v_buffer[layer],
                        indices_dst=plan.device, k_cache_src=k_src[layer],
                        v_cache_src=v_src[layer], indices_src=plan.host_gpu,
                        element_dim=host.element_dim, **tuning)
                return load
            return prepare
        (src,) = sources or (host.data_refs,)

        def prepare_mla(plan):
            def load(layer):
                hc.transfer_hicache_one_layer_mla(
                    cache_dst=pool.kv_buffer[layer], indices_dst=plan.device,
                    cache_src=src[layer], indices_src=plan.host_gpu,
                    element_dim=host.kv_cache_dim, **tuning)
            return load
        return prepare_mla

    def _split_load(self, spec, tokens):
        """A per-layer load shared by the SMs and the copy engine on two streams. The
        per-layer kernel moves each layer's first tokens, as SGLang's load does; for the
        last `copy_share` of them (whole pages) the copy engine makes one strided copy per
        layer, tensor and run of host pages into a dense device buffer, and torch's
        index_copy_ scatters those rows to their device pages. Both streams go layer by
        layer, so a layer is whole once both have passed it."""
        one_layer, layers = self._one_layer_loads(spec, tokens), range(self.geom.layers)
        dense, host_tensors, device_layers = self.load_buffer(tokens), self.host_tensors(), self.device_layers()
        streams = split_streams(DEVICE)

        def prepare(plan):
            count = len(plan.host_cpu)
            kernel_tokens = count - copy_engine_tokens(count, spec.copy_share)
            kernel = one_layer(plan.head(kernel_tokens))
            tail_device, runs = plan.device[kernel_tokens:], page_runs(plan.host_cpu[kernel_tokens:], True)
            copies = [[(dst[layer, s:s + n], src[h:h + n, layer]) for dst, src in zip(dense, host_tensors)
                       for s, h, n in runs] for layer in layers]
            scatters = [[(pool_layers[layer], dst[layer, :count - kernel_tokens])
                         for pool_layers, dst in zip(device_layers, dense)] for layer in layers]

            def copy_engine_part(layer):
                for dst, src in copies[layer]:
                    copy_rows(dst, src)
                for pool_layer, rows in scatters[layer]:
                    pool_layer.index_copy_(0, tail_device, rows)
            return lambda: split_schedule(layers, copy_engine_part, kernel, streams)
        return prepare

    def dense_source(self, tokens: int) -> list:
        """Per host tensor a dense pinned [layer][token][row] buffer of random rows, one row
        per host token index of the "consecutive" plans (pages 1 to tokens / PAGE)."""
        import torch
        key = ("dense", tokens)
        if key not in self.stage:
            self.stage[key] = []
            for t in self.host_tensors():
                buffer = torch.empty((self.geom.layers, PAGE + tokens, *t.shape[2:]), dtype=t.dtype,
                                     pin_memory=DEVICE == "cuda")
                for layer in buffer:   # a layer at a time: no device copy of the whole buffer
                    layer.copy_(random_bytes(layer.shape, t.dtype, DEVICE))
                self.stage[key].append(buffer)
        return self.stage[key]

    def _copies(self, spec, tokens):
        if spec.direction == "load":
            return self._layer_copies(tokens)
        return self._page_copies(spec, tokens)

    def _layer_copies(self, tokens):
        """A load through the copy engine, layer by layer as SGLang loads: per layer and
        tensor, one strided copy per run of host pages (source pitch: a token's rows of
        every layer; width: one row) into a dense [layer][token][row] device buffer."""
        if self.dry:
            def prepare_dry(plan):
                page_runs(plan.host_cpu, True)
                return lambda: None
            return prepare_dry
        dense, host_tensors = self.load_buffer(tokens), self.host_tensors()

        def prepare(plan):
            copies = [(dst[layer, s:s + n], src[h:h + n, layer]) for dst, src in zip(dense, host_tensors)
                      for layer in range(self.geom.layers) for s, h, n in page_runs(plan.host_cpu, True)]

            def run():
                for dst, src in copies:
                    copy_rows(dst, src)
            return run
        return prepare

    def load_buffer(self, tokens: int) -> list:
        key = ("load", tokens)
        if key not in self.stage:
            self.stage[key] = [torch_empty((self.geom.layers, tokens, *t.shape[2:]), t.dtype)
                               for t in self.host_tensors()]
        return self.stage[key]

    def _page_copies(self, spec, tokens):
        """The staged path's copies alone: page p of a device buffer in the staging
        layout ([token][layer][row], contiguous) to host page p of the plan, one
        cudaMemcpyAsync per page and tensor (or per run), all K pages then all V pages."""
        if self.dry:
            def prepare_dry(plan):
                page_runs(plan.host_cpu, spec.coalesce)
                return lambda: None
            return prepare_dry
        stage, host_tensors = self.staging_copy(tokens), self.host_tensors()

        def prepare(plan):
            pairs = [(dst[h:h + n], src[s:s + n]) for dst, src in zip(host_tensors, stage)
                     for s, h, n in page_runs(plan.host_cpu, spec.coalesce)]

            def run():
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
            return run
        return prepare

    def staging_copy(self, tokens: int) -> list:
        if tokens not in self.stage:
            self.stage[tokens] = [random_bytes((tokens, *t.shape[1:]), t.dtype, DEVICE)
                                  for t in self.host_tensors()]
        return self.stage[tokens]

    def check(self, spec: Spec, prepare, plan: Plan, tokens: int) -> bool:
        """Run the path once on `plan` over a poisoned destination; True if every
        destination row then holds its source's bytes."""
        if self.dry:
            return True
        run = prepare(plan)
        if spec.kind == "copies" and spec.direction == "load":
            return self._check_layer_copies(run, plan, tokens)
        if spec.host_pages == "dense":
            return self._check_dense_load(run, plan, tokens)
        if spec.kind == "copies":
            return self._check_backup(run, plan, [s[:len(plan.host_cpu)] for s in self.stage[tokens]])
        if spec.direction == "backup":
            return self._check_backup(run, plan)
        return self._check_load(run, plan)

    def _check_backup(self, run, plan, want=None) -> bool:
        for t in self.host_tensors():
            t[plan.host_cpu] = 0  # what the path fails to write stays zero; the device rows are random
        run()
        sync()
        want = self.device_rows(plan.device) if want is None else want
        return all(same_bytes(t[plan.host_cpu], w) for t, w in zip(self.host_tensors(), want))

    def _check_load(self, run, plan) -> bool:
        fresh = self._fresh_host_rows(plan)
        for layers in self.device_layers():
            for layer in layers:
                layer[plan.device] = 0
        run()
        sync()
        return all(same_bytes(f, d) for f, d in zip(fresh, self.device_rows(plan.device)))

    def _check_layer_copies(self, run, plan, tokens) -> bool:
        fresh = self._fresh_host_rows(plan)
        dense = self.load_buffer(tokens)
        for buffer in dense:
            buffer.zero_()
        run()
        sync()
        count = len(plan.host_cpu)  # staging tokens follow the plan's order
        return all(same_bytes(f.transpose(0, 1), d[:, :count]) for f, d in zip(fresh, dense))

    def _check_dense_load(self, run, plan, tokens) -> bool:
        rows, sources = plan.host_cpu, self.dense_source(tokens)
        fresh = [random_bytes((d.shape[0], len(rows), *d.shape[2:]), d.dtype, DEVICE).cpu() for d in sources]
        for dense, f in zip(sources, fresh):
            dense[:, rows] = f
        for layers in self.device_layers():
            for layer in layers:
                layer[plan.device] = 0
        run()
        sync()
        return all(same_bytes(f.transpose(0, 1), d) for f, d in zip(fresh, self.device_rows(plan.device)))

    def _fresh_host_rows(self, plan) -> list:
        # Fresh host bytes: after the timed runs the destination may already hold what
        # the host rows do, and a load that does nothing would pass.
        fresh = [random_bytes((len(plan.host_cpu), *t.shape[1:]), t.dtype, DEVICE).cpu()
                 for t in self.host_tensors()]
        for t, rows in zip(self.host_tensors(), fresh):
            t[plan.host_cpu] = rows
        return fresh

    def drop_stage(self, tokens: int):
        self.stage.pop(tokens, None)
        self.stage.pop(("load", tokens), None)
        self.stage.pop(("dense", tokens), None)

    def close(self):
        if not self.dry:
            self.host.destroy()  # unregisters the pinned host memory now, not at exit
        self.host = self.pool = None
        self.stage.clear()
        gc.collect()
        if DEVICE == "cuda" and not self.dry:
            import torch
            torch.cuda.empty_cache()
            # torch keeps freed pinned buffers (the dense source's) for reuse: give them back
            getattr(torch._C, "_host_emptyCache", lambda: None)()


# ---------------------------------------------------------------------------------------
# The compute a transfer competes with


class GemmLoad:
    """A bf16 GEMM loop on a stream of its own, and a second stream for the transfer."""

    def __init__(self):
        import torch
        self.torch = torch
        self.a, self.b = (torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        self.c = torch.empty_like(self.a)
        self.stream, self.side = torch.cuda.Stream(), torch.cuda.Stream()
        self.window(4)  # cuBLAS picks its kernel and workspace here
        self.per_gemm = statistics.median(self.window(8)[0] for _ in range(3)) / 8

    def window(self, count: int, run=None, i: int = 0):
        """Launch `count` GEMMs, then (if given) run(i) on the other stream; wait for both.
        Returns (GEMM loop s, transfer s, whether the transfer ended inside the loop)."""
        torch = self.torch
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        events[0].record(self.stream)
        with torch.cuda.stream(self.stream):
            for _ in range(count):
                torch.matmul(self.a, self.b, out=self.c)
        events[1].record(self.stream)
        if run is not None:
            with torch.cuda.stream(self.side):  # SGLang's kernels launch on torch's current stream
                events[2].record(self.side)
                run(i)
                events[3].record(self.side)
        torch.cuda.synchronize()
        gemm = events[0].elapsed_time(events[1]) / 1e3
        if run is None:
            return gemm, None, None
        inside = events[0].elapsed_time(events[3]) <= events[0].elapsed_time(events[1])
        return gemm, events[2].elapsed_time(events[3]) / 1e3, inside

    def beside(self, run, nbytes: int, reps: int) -> dict:
        alone = statistics.median(cuda_times(run, reps, warmup=WARMUP))
        count = math.ceil(GEMM_COVER * alone / self.per_gemm) + 2
        for i in range(WARMUP):
            self.window(count)
            self.window(count, run, i)
        gemm_alone = statistics.median(self.window(count)[0] for _ in range(reps))
        runs = [self.window(count, run, i) for i in range(reps)]
        gemm_with = statistics.median(r[0] for r in runs)
        xfer_with = statistics.median(r[1] for r in runs)
        return footprint_fields(count, self.per_gemm, gemm_alone, gemm_with, alone, xfer_with,
                                sum(r[2] for r in runs) / reps, nbytes)


def footprint_fields(count, per_gemm, gemm_alone, gemm_with, xfer_alone, xfer_with, inside, nbytes) -> dict:
    return dict(n_gemm=count, gemm_ms=per_gemm * 1e3, gemm_alone_ms=gemm_alone * 1e3,
                gemm_beside_ms=gemm_with * 1e3, gemm_slowdown=gemm_with / gemm_alone,
                # GEMM time lost per second of transfer: the share of the GPU the transfer took
                gemm_lost_share=(gemm_with - gemm_alone) / xfer_with,
                xfer_alone_GBps=nbytes / xfer_alone / 1e9, xfer_beside_GBps=nbytes / xfer_with / 1e9,
                inside_share=inside)


class FakeGemm:
    """--dry-run: runs the transfer once, makes the numbers up."""

    def beside(self, run, nbytes: int, reps: int) -> dict:
        run(0)
        xfer = nbytes / 50e9
        return footprint_fields(math.ceil(GEMM_COVER * xfer / 1.6e-3) + 2, 1.6e-3, 0.03, 0.031, xfer, xfer * 1.02,
                                1.0, nbytes)


# ---------------------------------------------------------------------------------------
# GPU run or dry run


def cuda_timer(run, reps, nbytes, kind):
    return cuda_times(run, reps, warmup=WARMUP)


FAKE_GBPS = {"link": 55.0, "staged": 49.0, "direct": 51.0, "copies": 52.0, "sglang": 50.0, "split": 53.0}


def fake_timer(run, reps, nbytes, kind):
    """Runs `run` as the CUDA timer would, returns made-up times 1-2% apart."""
    for i in range(WARMUP + reps):
        run(i)
    return [nbytes / (FAKE_GBPS[kind] * 1e9) * (1 + 0.01 * (i % 3)) for i in range(reps)]


def pinned_copies() -> dict:
    """The link: a 1 GiB copy between pinned host and device memory, each way."""
    import torch
    host = torch.empty(LINK_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(LINK_BYTES, dtype=torch.uint8, device="cuda")
    return {"backup": lambda i: host.copy_(dev, non_blocking=True),
            "load": lambda i: dev.copy_(host, non_blocking=True)}


def no_copies() -> dict:
    return {"backup": lambda i: None, "load": lambda i: None}


def module_name(module) -> str:
    kind, size, unroll, quota = module
    return f"{kind}(element_size={size}, unroll={unroll}, block_quota={quota})"


def jit_modules(geoms, quotas, facts: KernelFacts) -> list[tuple]:
    """Every JIT module the run needs: the measured (unroll, quota) pairs, and what the
    host pools build at start-up (hicache.py: can_use_hicache_jit_kernel,
    can_use_write_back_jit_kernel)."""
    modules = set()
    for geom in geoms:
        size = geom.element_size
        modules |= {("hicache", size, u, q) for u in load_unrolls(facts, size) for q in quotas}
        modules |= {("hicache", size, u, facts.default_quota) for u in facts.pool_unrolls(size)}
        modules.add(("staged", size, facts.default_unroll(size), facts.default_quota))
    return sorted(modules)


def build_jit_modules(modules) -> dict:
    """Compile the modules in parallel, then SGLang's cached module factories return
    them without a build. Each build runs ninja and nvcc in a subprocess of its own;
    load_jit takes a file lock per module and publishes a build by renaming it, so
    builds of different modules do not meet. Loading a built library (dlopen through
    tvm-ffi) is kept to one thread at a time: nothing is gained by doing it at once."""
    from sglang.kernels.jit.utils.compile import loader
    from sglang.kernels.ops.kvcache import hicache as hc
    factories = {"hicache": hc._jit_hicache_module, "staged": hc._jit_hicache_staged_module}
    started = time.monotonic()
    print(f"JIT: building {len(modules)} modules in parallel", flush=True)

    def build(module):
        kind, size, unroll, quota = module
        factories[kind](element_size=size, unroll=unroll, block_quota=quota)

    load, one_at_a_time = getattr(loader, "_load", None), threading.Lock()

    def serial_load(library):
        with one_at_a_time:
            return load(library)

    if load is not None:
        loader._load = serial_load
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(len(modules), os.cpu_count() or 1))) as pool:
            futures = [(m, pool.submit(build, m)) for m in modules]
    finally:
        if load is not None:
            loader._load = load
    errors = {module_name(m): describe(f.exception()) for m, f in futures if f.exception() is not None}
    seconds = time.monotonic() - started
    print(f"JIT: {len(modules) - len(errors)} of {len(modules)} built in {seconds:.0f} s", flush=True)
    return dict(modules=[module_name(m) for m in modules], seconds=seconds, errors=errors)


def listed_modules(modules) -> dict:
    return dict(modules=[module_name(m) for m in modules], seconds=0.0, errors={})


@dataclass
class Backend:
    """What differs between a GPU run and a dry run."""

    dry: bool
    facts: KernelFacts
    timer: Callable  # (run, reps, nbytes, kind) -> seconds per repetition
    link: Callable[[], dict]  # direction -> run(i)
    make_gemm: Callable[[], object]
    build: Callable[[list], dict]  # JIT modules -> what was built
    _gemm: object = None

    def gemm(self):
        if self._gemm is None:
            self._gemm = self.make_gemm()
        return self._gemm

    def pool_bench(self, geom, max_tokens, gen) -> PoolBench:
        return PoolBench(geom, max_tokens, gen, dry=self.dry)


def cuda_backend() -> Backend:
    import_sglang("patched-dense")  # SGLang's own pools, single-rank stubs
    return Backend(dry=False, facts=sglang_kernel_facts(), timer=cuda_timer, link=pinned_copies,
                   make_gemm=GemmLoad, build=build_jit_modules)


def dry_backend() -> Backend:
    return Backend(dry=True, facts=DRY_FACTS, timer=fake_timer, link=no_copies, make_gemm=FakeGemm,
                   build=listed_modules)


# ---------------------------------------------------------------------------------------
# Rows, the driver and the tables


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


def row_label(row: dict) -> str:
    parts = [str(row[k]) for k in ("pool", "direction", "path") if row.get(k) is not None]
    return (" ".join(parts) + (f" @ {row['tokens']} tokens" if row.get("tokens") else "")
            + (f", repeat {row['repeat']}" if "repeat" in row else ""))


def progress_line(row: dict, elapsed: float) -> str:
    head = f"[{elapsed:6.1f} s] {row_label(row)}"
    if "error" in row:
        return f"{head}: {row['error']}"
    if "gemm_slowdown" in row:
        return (f"{head}: GEMM x{row['gemm_slowdown']:.3f} ({row['gemm_lost_share']:.3f} of it while the "
                f"transfer ran), transfer {row['xfer_beside_GBps']:.2f} GB/s beside it")
    of_link = row.get("of_link")
    return (f"{head}: {row['GBps']:.2f} GB/s" + (f" ({of_link:.3f} of the link)" if of_link else "")
            + (f", bytes ok: {row['bytes_ok']}" if "bytes_ok" in row else ""))


class Recorder:
    """Rows as they come: kept, written to --out (replaced whole each time) and logged."""

    def __init__(self, out: str, meta: dict, deadline: float, started: float):
        self.out, self.deadline, self.started = out, deadline, started
        self.data = {"meta": meta, "rows": [], "footprint": []}
        self.write()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def expired(self) -> bool:
        return self.deadline is not None and self.elapsed() > self.deadline

    def add(self, row: dict, table: str = "rows"):
        self.data[table].append(row)
        self.write()
        print(progress_line(row, self.elapsed()), flush=True)

    def write(self):
        partial = f"{self.out}.partial"
        with open(partial, "w") as handle:
            json.dump(self.data, handle, indent=1)
        os.replace(partial, self.out)  # never a half-written file, even when killed


def row_fields(geom: Geometry, spec: Spec, tokens: int, facts: KernelFacts, host_tokens=None) -> dict:
    return dict(pool=geom.label, direction=spec.direction, path=spec.name, tokens=tokens,
                **launch_shape(spec, geom, tokens, facts, host_tokens))


def measure_link(rec: Recorder, backend: Backend, reps: int) -> dict:
    link = {}
    for direction, run in backend.link().items():
        fields = dict(pool="link", direction=direction, path=f"pinned copy, {LINK_BYTES >> 30} GiB", tokens=None)
        if rec.expired():
            rec.add(dict(fields, error=NOT_STARTED))
            continue
        try:
            row = timed_row(LINK_BYTES, backend.timer(run, reps, LINK_BYTES, "link"), **fields)
            link[direction] = row["GBps"]
        except Exception as exc:
            row = dict(fields, error=describe(exc))
        rec.add(row)
    return link


def measure_path(bench: PoolBench, spec: Spec, tokens: int, plans, reps: int, backend: Backend,
                 rec: Recorder, link: dict):
    """Time one path over the rotating plans, check its bytes, record the row.
    Returns the timed callable (for the footprint), or None if it failed."""
    if rec.expired():
        rec.add(dict(row_fields(bench.geom, spec, tokens, backend.facts), error=NOT_STARTED))
        return None
    nbytes, group = tokens * bench.geom.token_bytes, plans[spec.host_pages]
    fields = row_fields(bench.geom, spec, tokens, backend.facts, group[0].host_cpu)
    try:
        prepare = bench.operation(spec, tokens)
        operations = [prepare(plan) for plan in group]

        def run(i):
            operations[i % len(operations)]()
        row = timed_row(nbytes, backend.timer(run, reps, nbytes, spec.kind), **fields)
    except Exception as exc:
        rec.add(dict(fields, error=describe(exc)))
        return None
    row["of_link"] = row["GBps"] / link[spec.direction] if link.get(spec.direction) else None
    check_plan = group[0].head(min(tokens, CHECK_TOKENS))
    row["check_tokens"] = len(check_plan.host_cpu)
    try:
        row["bytes_ok"] = bench.check(spec, prepare, check_plan, tokens)
    except Exception as exc:
        row.update(bytes_ok=False, check_error=describe(exc))
    rec.add(row)
    return run


def measure_footprint(bench: PoolBench, chosen: list, tokens: int, plans, reps: int, backend: Backend,
                      rec: Recorder, link: dict, repeats: int = 1):
    """Each chosen (spec, run): the GEMM loop alone and with the transfer beside it,
    `repeats` times, the paths taking turns (so that drift between the first and the last
    minute does not fall on one path)."""
    nbytes = tokens * bench.geom.token_bytes
    for repeat, (spec, run) in ((r, c) for r in range(repeats) for c in chosen):
        host_tokens = plans[spec.host_pages][0].host_cpu if plans else None
        fields = dict(row_fields(bench.geom, spec, tokens, backend.facts, host_tokens), repeat=repeat)
        if rec.expired():
            rec.add(dict(fields, error=NOT_STARTED), "footprint")
            continue
        if run is None:
            rec.add(dict(fields, error="not measured: the path failed in its bandwidth row"), "footprint")
            continue
        try:
            row = dict(fields, **backend.gemm().beside(run, nbytes, reps))
            row["xfer_beside_of_link"] = (row["xfer_beside_GBps"] / link[spec.direction]
                                          if link.get(spec.direction) else None)
        except Exception as exc:
            row = dict(fields, error=describe(exc))
        rec.add(row, "footprint")


def measure_pool(geom: Geometry, args, backend: Backend, rec: Recorder, link: dict, gen):
    unrolls = load_unrolls(backend.facts, geom.element_size)
    overlaps = backend.facts.staged_overlaps
    wanted = [] if args.skip_footprint else footprint_specs(unrolls[0], args.quotas, overlaps)
    if rec.expired():  # no pools built for nothing; the rows still say what was not started
        for tokens in args.tokens:
            for spec in path_specs(tokens, args.quotas, unrolls, overlaps):
                rec.add(dict(row_fields(geom, spec, tokens, backend.facts), error=NOT_STARTED))
            if tokens == footprint_tokens(args.tokens):
                for repeat, spec in ((r, s) for r in range(args.footprint_repeats) for s in wanted):
                    rec.add(dict(row_fields(geom, spec, tokens, backend.facts), repeat=repeat, error=NOT_STARTED),
                            "footprint")
        return
    bench = backend.pool_bench(geom, max(args.tokens), gen)
    try:
        for tokens in args.tokens:
            plans = None if rec.expired() else bench.plans(tokens)  # past the deadline rows only say so
            runs = {}
            specs = path_specs(tokens, args.quotas, unrolls, overlaps)
            for spec in specs[::-1] if args.reverse else specs:
                runs[spec] = measure_path(bench, spec, tokens, plans, args.reps, backend, rec, link)
            if tokens == footprint_tokens(args.tokens) and wanted:
                measure_footprint(bench, [(s, runs.get(s)) for s in wanted], tokens, plans, args.reps, backend,
                                  rec, link, args.footprint_repeats)
            bench.drop_stage(tokens)
    finally:
        bench.close()


def run_benchmark(args, backend: Backend, started: float) -> dict:
    import torch
    rec = Recorder(args.out, meta_block(args, backend.dry), args.deadline, started)
    geoms = [GEOMETRIES[p] for p in args.parts]
    link = measure_link(rec, backend, args.reps)
    rec.data["meta"]["jit"] = backend.build(jit_modules(geoms, args.quotas, backend.facts))
    rec.write()
    gen = torch.Generator().manual_seed(0)
    for geom in geoms:
        try:
            measure_pool(geom, args, backend, rec, link, gen)
        except Exception as exc:  # the pools could not be built: the other shape still runs
            rec.add(dict(pool=geom.label, error=describe(exc)))
    print(tables(rec.data), flush=True)
    return rec.data


def nvidia_driver() -> str:
    try:
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({describe(exc)})"
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else "unknown"


def meta_block(args, dry: bool) -> dict:
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), args=vars(args), dry_run=dry, page_size=PAGE,
                warmup=WARMUP, check_tokens=CHECK_TOKENS, copy_tokens=list(COPY_TOKENS),
                footprint_tokens=footprint_tokens(args.tokens),
                gemm=f"bf16 {GEMM_N}x{GEMM_N} @ {GEMM_N}x{GEMM_N}, loop of {GEMM_COVER}x the transfer alone + 2",
                geometry={k: asdict(g) for k, g in GEOMETRIES.items() if k in args.parts})
    if dry:
        return dict(meta, gpu="none: --dry-run, made-up timings")
    import sglang
    import torch
    site = os.path.dirname(os.path.dirname(sglang.__file__))
    try:
        series = series_applied(site)
    except Exception as exc:
        series = f"unknown ({describe(exc)})"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (no CUDA device)"
    return dict(meta, gpu=gpu, driver=nvidia_driver(), torch=torch.__version__,
                cuda=torch.version.cuda, sglang=os.path.dirname(sglang.__file__), series=series)


def cell(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def footprint_spread(measured: list) -> list[dict]:
    """The footprint rows of each (pool, direction, path) gathered over the repeats."""
    grouped: dict = {}
    for r in measured:
        key = (r["pool"], r["direction"], r["path"])
        entry = grouped.setdefault(key, dict(pool=r["pool"], direction=r["direction"], path=r["path"],
                                             grid=r["grid"], slowdowns=[], beside_GBps=[], inside=[]))
        entry["slowdowns"].append(r["gemm_slowdown"])
        entry["beside_GBps"].append(r["xfer_beside_GBps"])
        entry["inside"].append(r["inside_share"])
    return list(grouped.values())


def spread_cell(values, digits) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def tables(data: dict) -> str:
    rows, meta = data["rows"], data["meta"]
    link = {r["direction"]: r["GBps"] for r in rows if r.get("pool") == "link" and "GBps" in r}
    ok = {True: "yes", False: "NO", None: "-"}
    lines = [f"{meta.get('gpu')}, driver {meta.get('driver', '-')}, torch {meta.get('torch', '-')}, "
             f"SGLang {meta.get('sglang', '-')} ({meta.get('series', '-')}), {meta['date']}",
             f"pinned copy ({LINK_BYTES >> 30} GiB): D2H {cell(link.get('backup'))} GB/s, "
             f"H2D {cell(link.get('load'))} GB/s", "",
             "| pool | dir | path | tokens | GB/s | /link | bytes ok | grid (blocks x threads) | kernels | copies |",
             "|---|---|---|---:|---:|---:|---|---|---:|---:|"]
    for r in rows:
        if r.get("pool") == "link" or "error" in r:
            continue
        lines.append(f"| {r['pool']} | {r['direction']} | {r['path']} | {r['tokens']} | {r['GBps']:.2f} "
                     f"| {cell(r.get('of_link'), 3)} | {ok[r.get('bytes_ok')]} | {r['grid']} | {r['kernels']} "
                     f"| {r['copies']} |")
    lines += [f"check failed: {row_label(r)}: {r['check_error']}" for r in rows if "check_error" in r]
    measured = [r for r in data["footprint"] if "error" not in r]
    if measured:
        lines += ["", "Footprint: a bf16 GEMM loop alone and with one transfer on another stream",
                  "| pool | dir | path | tokens | repeat | grid | GEMMs | GEMM ms alone | beside | slowdown "
                  "| GEMM lost / transfer s | transfer GB/s alone | beside | /link | inside |",
                  "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in measured:
        lines.append(f"| {r['pool']} | {r['direction']} | {r['path']} | {r['tokens']} | {r.get('repeat', 0)} "
                     f"| {r['grid']} | {r['n_gemm']} "
                     f"| {r['gemm_alone_ms']:.2f} | {r['gemm_beside_ms']:.2f} | {r['gemm_slowdown']:.3f} "
                     f"| {r['gemm_lost_share']:.3f} | {r['xfer_alone_GBps']:.2f} | {r['xfer_beside_GBps']:.2f} "
                     f"| {cell(r.get('xfer_beside_of_link'), 3)} | {r['inside_share']:.2f} |")
    spread = footprint_spread(measured)
    if any(len(s["slowdowns"]) > 1 for s in spread):
        lines += ["", "Footprint over the repeats: GEMM slowdown and the transfer's GB/s beside the GEMM, "
                  "median [min, max]",
                  "| pool | dir | path | grid | repeats | GEMM slowdown | transfer beside GB/s | inside |",
                  "|---|---|---|---|---:|---:|---:|---:|"]
        for s in spread:
            lines.append(f"| {s['pool']} | {s['direction']} | {s['path']} | {s['grid']} | {len(s['slowdowns'])} "
                         f"| {spread_cell(s['slowdowns'], 3)} | {spread_cell(s['beside_GBps'], 1)} "
                         f"| {spread_cell(s['inside'], 2)} |")
    errors = [f"not measured: {row_label(r)}: {r['error']}" for r in rows + data["footprint"] if "error" in r]
    jit_errors = [f"JIT build failed: {name}: {e}" for name, e in meta.get("jit", {}).get("errors", {}).items()]
    return "\n".join(lines + ([""] if errors or jit_errors else []) + errors + jit_errors)


# ---------------------------------------------------------------------------------------
# Command line


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int_list, default=list(TOKENS),
                    help=f"batch sizes in tokens, multiples of {PAGE} (default {','.join(map(str, TOKENS))})")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per row, after two warm-ups")
    ap.add_argument("--parts", default=",".join(PARTS), help="mha, mla or both")
    ap.add_argument("--quotas", type=int_list, default=list(QUOTAS),
                    help="block quotas of the direct kernels (each is a JIT module per unroll and row size)")
    ap.add_argument("--skip-footprint", action="store_true", help="no GEMM-beside-transfer measurement")
    ap.add_argument("--footprint-repeats", type=int, default=3,
                    help="times each footprint row is measured, the paths taking turns (default 3)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "link-paths.json"))
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from start after which no row starts (the rest are listed as not started); "
                         "default: none")
    ap.add_argument("--reverse", action="store_true",
                    help="time each batch size's paths in reverse order: a row that moves with its "
                         "place in the order shows what the order is worth")
    ap.add_argument("--dry-run", action="store_true", help="no GPU, no SGLang: made-up timings")
    args = ap.parse_args(argv)
    bad = [t for t in args.tokens if t <= 0 or t % PAGE]
    if bad:
        ap.error(f"--tokens: {bad} not positive multiples of the page size {PAGE}")
    if len(set(args.tokens)) != len(args.tokens):
        ap.error("--tokens: a size is listed twice")
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(args.parts) - set(PARTS)) or ([] if args.parts else ["(none)"])
    if unknown:
        ap.error(f"--parts: unknown {','.join(unknown)} (any of {','.join(PARTS)})")
    if len(set(args.parts)) != len(args.parts):
        ap.error("--parts: a part is listed twice")
    if any(q <= 0 for q in args.quotas):
        ap.error("--quotas: block quotas must be positive")
    if args.reps < 1:
        ap.error("--reps: at least 1")
    if args.footprint_repeats < 1:
        ap.error("--footprint-repeats: at least 1")
    directory = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(directory):
        ap.error(f"--out: no directory {directory}")
    return args


def main(argv=None):
    started = time.monotonic()
    args = parse_args(argv)
    backend = dry_backend() if args.dry_run else cuda_backend()
    run_benchmark(args, backend, started)


if __name__ == "__main__":
    main()
