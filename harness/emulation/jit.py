"""A stand-in for ``load_jit`` whose modules run the HiCache and Mamba JIT kernels on CPU.

SGLang's wrappers (kernels/ops/kvcache/hicache.py, kernels/ops/mamba/transfer_mamba.py)
build a module with ``load_jit(name, *template_args, cuda_files=[...],
cuda_wrappers=[(export, "&Class<args>::method"), ...])`` and call its exports. This
loader "compiles" the same request: it reads the named .cuh files of the tree under
test (KERNEL_PATH/csrc), finds each exported host function's parameter list there,
rejects template arguments the C++ would not compile (static_asserts), and returns a
module whose exports

* take exactly the parameters the tree's kernel declares (a wrapper passing one too
  many or too few fails as tvm-ffi fails), typed as declared (a tensor for a
  TensorView, an int for an int64_t);
* run the host code's checks (TensorMatcher, RuntimeCheck) with its messages;
* copy bytes where the device code would: ``ptr[layer] + index * stride`` and so on.

Where a tree's kernel takes one more trailing ``int64_t`` than SGLang 0.5.20's (the
series' token or slot stride), the emulation uses it as the kernels of that tree do;
without it, the stride is what 0.5.20 hard-codes (the element or item size). A kernel
whose signature is neither is refused, so a changed kernel cannot go unemulated.
Every build and launch is recorded (template arguments, grid size) for the tests of
launch geometry.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from harness.emulation.memory import (
    ANY, KernelError, Region, Symbol, as_int, check, copy, ints, match, table,
)

WARP_THREADS = 32
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass
class Launch:
    export: str
    template: tuple
    blocks: int


@dataclass
class Recorder:
    """What the emulated loader built and launched, in order."""

    builds: list = field(default_factory=list)    # (module name, template args)
    launches: list = field(default_factory=list)  # Launch
    host_copies: list = field(default_factory=list)  # (host address, bytes) of each staged copy


# ---------------------------------------------------------------------------------
# hicache.cuh: HiCacheKernel<kElementSize, kUnroll, kBlockQuota, kBlockSize>

def _hicache_compiles(element_size, unroll, block_quota, block_size):
    # load_vec/store_vec: kBytes % 128 == 0, a 4/8/16-byte package per lane
    # (128 / (32 / unroll)), kBlockSize a multiple of a warp.
    check(element_size % 128 == 0, f"static_assert: kBytes must be multiple of 128 bytes ({element_size})")
    check(unroll in (1, 2, 4), f"static_assert: Unsupported memory package size (unroll {unroll})")
    check(block_size % WARP_THREADS == 0 and block_size > 0, f"static_assert: kBlockSize {block_size}")
    check(block_quota > 0, f"kBlockQuota {block_quota}")


def _blocks(template, length):
    element_size, unroll, block_quota, block_size = template
    workers_per_block = block_size // (WARP_THREADS // unroll)
    blocks = min(-(-length // workers_per_block), block_quota)
    # cudaLaunchKernelEx with a zero grid: cudaErrorInvalidConfiguration.
    check(blocks > 0, "CUDA error: invalid configuration argument (no indices to launch over)")
    return blocks


def _one_layer(template, pairs, idx_dst, idx_src, label):
    """run_one / run_one_mla: (dst, src) caches of shape [-1, D], row strides M and N."""
    element_size = template[0]
    D, N, M, L = Symbol("head dimension"), Symbol("src stride"), Symbol("dst stride"), Symbol("indices length")
    cache_dtype, index_dtype = Symbol("cache dtype"), Symbol("indices dtype", INDEX_DTYPES)
    for dst, src in pairs:
        match("cache_src", src, (ANY, D), strides=(N, 1), dtype=cache_dtype)
    for dst, src in pairs:
        match("cache_dst", dst, (ANY, D), strides=(M, 1), dtype=cache_dtype)
    match("indices_src", idx_src, (L,), dtype=index_dtype)
    match("indices_dst", idx_dst, (L,), dtype=index_dtype)
    itemsize = cache_dtype.unwrap().itemsize
    check(element_size == D.unwrap() * itemsize, f"{label}: cache dimension mismatch.")
    src_stride, dst_stride = N.unwrap() * itemsize, M.unwrap() * itemsize
    blocks = _blocks(template, L.unwrap())
    regions = [(Region.of_tensor(d, "cache_dst"), Region.of_tensor(s, "cache_src")) for d, s in pairs]
    for pos_dst, pos_src in zip(ints(idx_dst), ints(idx_src)):
        for dst, src in regions:
            copy(dst, pos_dst * dst_stride, src, pos_src * src_stride, element_size)
    return blocks


def _all_layer(template, tables, idx_dst, idx_src, src_stride, dst_stride):
    """run_all / run_all_mla: per layer, ptr[layer] + index * stride, kElementSize bytes."""
    element_size = template[0]
    N, L = Symbol("num_layers"), Symbol("indices length")
    index_dtype = Symbol("indices dtype", INDEX_DTYPES)
    resolved = [(table(f"{name}_dst", dst, N), table(f"{name}_src", src, N)) for name, dst, src in tables]
    match("indices_src", idx_src, (L,), dtype=index_dtype)
    match("indices_dst", idx_dst, (L,), dtype=index_dtype)
    blocks = _blocks(template, L.unwrap())
    for pos_dst, pos_src in zip(ints(idx_dst), ints(idx_src)):
        for dst_layers, src_layers in resolved:
            for dst, src in zip(dst_layers, src_layers):
                copy(dst, pos_dst * dst_stride, src, pos_src * src_stride, element_size)
    return blocks


def run_one(t, k_cache_dst, v_cache_dst, indices_dst, k_cache_src, v_cache_src, indices_src):
    return _one_layer(t, [(k_cache_dst, k_cache_src), (v_cache_dst, v_cache_src)], indices_dst, indices_src,
                      "HicacheKernel")


def run_one_mla(t, cache_dst, indices_dst, cache_src, indices_src):
    return _one_layer(t, [(cache_dst, cache_src)], indices_dst, indices_src, "HicacheKernel MLA")


def run_all(t, k_ptr_dst, v_ptr_dst, indices_dst, k_ptr_src, v_ptr_src, indices_src, src_stride, dst_stride):
    return _all_layer(t, [("k_ptr", k_ptr_dst, k_ptr_src), ("v_ptr", v_ptr_dst, v_ptr_src)], indices_dst,
                      indices_src, as_int("kv_src_stride_bytes", src_stride), as_int("kv_dst_stride_bytes", dst_stride))


def run_all_mla(t, ptr_dst, indices_dst, ptr_src, indices_src, src_stride, dst_stride):
    return _all_layer(t, [("ptr", ptr_dst, ptr_src)], indices_dst, indices_src,
                      as_int("src_stride_bytes", src_stride), as_int("dst_stride_bytes", dst_stride))


# ---------------------------------------------------------------------------------
# staged_write_back.cuh + relayout.cuh: HiCacheStagedWriteBackKernel<...>

def _staged_compiles(element_size, unroll, block_quota, block_size):
    check(element_size % 16 == 0,
          f"static_assert: hicache_relayout_kernel requires 16-byte aligned element size ({element_size})")


def _staged(template, dsts, dst_indices_cpu, stagings, page_indices_src, ptr_srcs, page_size, stride,
            merge_host_runs=False, host_copies=None):
    """run_staged_impl: relayout the pages into staging, then copy them to host: one copy per
    page, or (merge_host_runs: a tree whose kernel has consecutive_host_pages) one per run
    of consecutive host pages. Each copy's host address and size go to host_copies."""
    element_size = template[0]
    T, N, D, P = Symbol("num_tokens"), Symbol("num_layers"), Symbol("element_dim"), Symbol("num_pages")
    cache_dtype = Symbol("cache dtype")
    for staging in stagings:
        match("staging", staging, (T, N, D), dtype=cache_dtype)
    for dst in dsts:
        match("cache_dst", dst, (ANY, N, D), dtype=cache_dtype)
    sources = [table("ptr_src", ptrs, N) for ptrs in ptr_srcs]
    match("page_indices_src", page_indices_src, (P,), dtype=INDEX_DTYPES)
    match("dst_indices_cpu", dst_indices_cpu, (T,), dtype=(torch.int64,))
    page_size = as_int("page_size", page_size)
    check(page_size > 0, "HiCache staged relayout: page_size must be positive")
    check(T.unwrap() == P.unwrap() * page_size, "HiCache staged relayout: staging token count mismatch")
    check(element_size == D.unwrap() * cache_dtype.unwrap().itemsize, "HiCache staged relayout: element size mismatch")
    check(element_size % 16 == 0, "HiCache staged relayout: element size must be 16-byte aligned")
    if stride is None:
        stride = element_size  # SGLang 0.5.20: a layer's tokens back to back
    else:
        stride = as_int("src_stride_bytes", stride)
        check(stride >= element_size and stride % 16 == 0,
              "HiCache staged relayout: source token stride must be >= the element size and 16-byte aligned")
    layers, pages = N.unwrap(), ints(page_indices_src)
    # relayout.cuh: staging[p * page + t, layer] <- ptr_src[layer] + (src_page + t) * stride
    for staging, layer_srcs in zip(stagings, sources):
        out = Region.of_tensor(staging, "staging")
        for p, src_page in enumerate(pages):
            for t in range(page_size):
                for layer, src in enumerate(layer_srcs):
                    row = (p * page_size + t) * layers + layer
                    copy(out, row * element_size, src, (src_page + t) * stride, element_size)
    # copy_page_first_pages_*: page p of staging -> host row dst_indices[p * page_size]
    host_rows = ints(dst_indices_cpu)
    for staging, dst in zip(stagings, dsts):
        check(staging.dtype == dst.dtype, "Source and destination tensors must have the same dtype")
        src_page_bytes = page_size * staging.stride(0) * staging.element_size()
        dst_page_bytes = page_size * dst.stride(0) * dst.element_size()
        check(src_page_bytes == dst_page_bytes, "Source and destination page spans must match")
        src_region, dst_region = Region.of_tensor(staging, "staging"), Region.of_tensor(dst, "cache_dst")
        p = 0
        while p < len(pages):
            run = 1
            while merge_host_runs and p + run < len(pages) and (
                    host_rows[(p + run) * page_size] == host_rows[p * page_size] + run * page_size):
                run += 1
            offset = host_rows[p * page_size] * dst.stride(0) * dst.element_size()
            copy(dst_region, offset, src_region, p * src_page_bytes, run * src_page_bytes)
            if host_copies is not None:
                host_copies.append((dst.data_ptr() + offset, run * src_page_bytes))
            p += run
    return len(pages)


def run_all_lf_pf_staged(t, k_cache_dst, v_cache_dst, dst_indices_cpu, staging_k, staging_v, page_indices_src,
                         k_ptr_src, v_ptr_src, page_size, *stride, **copying):
    return _staged(t, [k_cache_dst, v_cache_dst], dst_indices_cpu, [staging_k, staging_v], page_indices_src,
                   [k_ptr_src, v_ptr_src], page_size, *(stride or (None,)), **copying)


def run_all_mla_lf_pf_staged(t, cache_dst, dst_indices_cpu, staging, page_indices_src, ptr_src, page_size, *stride,
                             **copying):
    return _staged(t, [cache_dst], dst_indices_cpu, [staging], page_indices_src, [ptr_src], page_size,
                   *(stride or (None,)), **copying)


# ---------------------------------------------------------------------------------
# transfer_mamba.cuh: TransferMambaKernel

def _mamba_checks(src_indices, dst_indices, item_size, slot_stride, L):
    match("src_indices", src_indices, (L,), dtype=(torch.int64,))
    match("dst_indices", dst_indices, (L,), dtype=(torch.int64,))
    item_size = as_int("item_size", item_size)
    check(item_size > 0, "transfer_mamba: item_size must be positive")
    check(item_size % 16 == 0, "transfer_mamba: item_size must be 16-byte aligned (uint4)")
    if slot_stride is None:
        return item_size, item_size  # SGLang 0.5.20: device slots back to back
    slot_stride = as_int("slot_stride", slot_stride)
    check(slot_stride >= item_size and slot_stride % 16 == 0,
          "transfer_mamba: device slot stride must be >= item_size and 16-byte aligned")
    return item_size, slot_stride


def run_pf_lf(t, src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim, *slot_stride):
    """Load: host slot (page first) -> one device layer."""
    L = Symbol("num_indices")
    item_size, stride = _mamba_checks(src_indices, dst_indices, item_size, (slot_stride or (None,))[0], L)
    layer_id, src_layout_dim = as_int("layer_id", layer_id), as_int("src_layout_dim", src_layout_dim)
    if L.unwrap() == 0:
        return 0
    src_region, dst_region = Region.of_tensor(src, "src"), Region.of_tensor(dst, "dst")
    for s, d in zip(ints(src_indices), ints(dst_indices)):
        copy(dst_region, d * stride, src_region, s * src_layout_dim + layer_id * item_size, item_size)
    return min(2, L.unwrap())


def run_lf_pf(t, src_ptrs, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers, *slot_stride):
    """Backup: every device layer -> host slot (page first)."""
    L = Symbol("num_indices")
    item_size, stride = _mamba_checks(src_indices, dst_indices, item_size, (slot_stride or (None,))[0], L)
    num_layers, dst_layout_dim = as_int("num_layers", num_layers), as_int("dst_layout_dim", dst_layout_dim)
    layers = table("src_ptrs", src_ptrs, num_layers)
    check(num_layers > 0, "transfer_mamba: num_layers must be positive")
    if L.unwrap() == 0:
        return 0
    dst_region = Region.of_tensor(dst, "dst")
    for s, d in zip(ints(src_indices), ints(dst_indices)):
        for layer, src in enumerate(layers):
            copy(dst_region, d * dst_layout_dim + layer * item_size, src, s * stride, item_size)
    return min(2, L.unwrap() * num_layers)


def _mamba_compiles(*template):
    check(not template, f"TransferMambaKernel takes no template arguments, got {template}")


# (class, method) -> (emulation, number of parameters in SGLang 0.5.20, compile check)
KERNELS = {
    ("HiCacheKernel", "run_one"): (run_one, 6, _hicache_compiles),
    ("HiCacheKernel", "run_all"): (run_all, 8, _hicache_compiles),
    ("HiCacheKernel", "run_one_mla"): (run_one_mla, 4, _hicache_compiles),
    ("HiCacheKernel", "run_all_mla"): (run_all_mla, 6, _hicache_compiles),
    ("HiCacheStagedWriteBackKernel", "run_all_lf_pf_staged"): (run_all_lf_pf_staged, 9, _staged_compiles),
    ("HiCacheStagedWriteBackKernel", "run_all_mla_lf_pf_staged"): (run_all_mla_lf_pf_staged, 6, _staged_compiles),
    ("TransferMambaKernel", "run_pf_lf"): (run_pf_lf, 7, _mamba_compiles),
    ("TransferMambaKernel", "run_lf_pf"): (run_lf_pf, 7, _mamba_compiles),
}


# ---------------------------------------------------------------------------------
# The loader

_WRAPPER = re.compile(r"^&(\w+)(?:<([^>]*)>)?::(\w+)$")


def host_signature(sources: list[Path], cls: str, method: str) -> list[tuple[str, str]]:
    """[(type, name)] of `static void method(...)` inside `struct cls` in the sources."""
    for path in sources:
        text = path.read_text()
        start = text.find(f"struct {cls} ")
        if start < 0:
            continue
        head = re.compile(rf"static\s+void\s+{method}\s*\(").search(text, start)
        if head is None:
            break
        body = text[head.end(): text.index(")", head.end())]
        params = []
        for piece in body.split(","):
            piece = " ".join(piece.split())
            if piece:
                kind, name = piece.rsplit(" ", 1)
                params.append(("tensor" if "TensorView" in kind else "int", name))
        return params
    raise KernelError(f"compile error: no static void {cls}::{method} in {[str(p) for p in sources]}")


class EmulatedKernel:
    """One export of an emulated JIT module."""

    def __init__(self, export, emulation, params, template, recorder):
        self.export, self.emulation, self.params = export, emulation, params
        self.template, self.recorder = template, recorder

    def __call__(self, *args):
        if len(args) != len(self.params):
            raise TypeError(f"{self.export}: Mismatched number of arguments, expected {len(self.params)} "
                            f"({', '.join(name for _, name in self.params)}) but got {len(args)}")
        for (kind, name), value in zip(self.params, args):
            if kind == "tensor":
                check(isinstance(value, torch.Tensor),
                      f"{self.export}: {name} expects a tensor, got {type(value).__name__}")
            else:
                as_int(f"{self.export}: {name}", value)
        blocks = self.emulation(self.template, *args)
        self.recorder.launches.append(Launch(self.export, self.template, blocks))


class EmulatedModule:
    def __init__(self, name, exports):
        self.name = name
        for export, kernel in exports.items():
            setattr(self, export, kernel)


def make_loader(kernel_root: Path, recorder: Recorder):
    """load_jit's stand-in for the tree whose JIT sources live in kernel_root (KERNEL_PATH)."""

    def load_jit(*args, cpp_files=None, cuda_files=None, cpp_wrappers=None, cuda_wrappers=None, **_flags):
        name, template_args = args[0], args[1:]
        sources = [kernel_root / "csrc" / f for f in cuda_files or []]
        for path in sources:
            check(path.is_file(), f"compile error: {path} does not exist")
        check(not cpp_files and not cpp_wrappers, f"{name}: only CUDA wrappers are emulated")
        exports = {}
        for export, target in cuda_wrappers or []:
            found = _WRAPPER.match(target.strip())
            check(found is not None, f"{name}: cannot parse wrapper target {target!r}")
            cls, targs, method = found.groups()
            template = tuple(int(a) for a in targs.split(",")) if targs else ()
            if (cls, method) not in KERNELS:
                raise KernelError(f"{name}: no emulation of {cls}::{method}; add one to {__name__}")
            emulation, pristine_arity, compiles = KERNELS[(cls, method)]
            params = host_signature(sources, cls, method)
            if len(params) not in (pristine_arity, pristine_arity + 1) or (
                    len(params) > pristine_arity and params[-1][0] != "int"):
                raise KernelError(f"{cls}::{method}{[p for _, p in params]}: a signature this emulation does "
                                  f"not know; update {__name__}")
            compiles(*template)
            if cls == "HiCacheStagedWriteBackKernel":
                merges = any("consecutive_host_pages" in path.read_text() for path in sources)
                emulation = functools.partial(emulation, merge_host_runs=merges, host_copies=recorder.host_copies)
            exports[export] = EmulatedKernel(export, emulation, params, template, recorder)
        recorder.builds.append((name, tuple(str(a) for a in template_args)))
        return EmulatedModule(name, exports)

    return load_jit
