"""Exact CPU stand-ins for SGLang's HiCache transfer kernels, for the CPU tier.

Each reproduces its kernel's address arithmetic, not its intent: the JIT all-layer and
staged kernels and the Mamba kernels copy raw bytes at `table[layer] + row * stride`
(ctypes.memmove on CPU memory), so a wrong table or stride copies wrong bytes here
exactly as on a GPU. The one-layer kernel and the AOT `direct` kernels go through the
tensors' own strides (`.view(-1, dim)` and `Tensor.copy_`), as the real ones do.
The sources these mirror are named beside each function.
"""
from __future__ import annotations

import ctypes

import torch


def _memmove(dst: int, src: int, nbytes: int):
    ctypes.memmove(dst, src, nbytes)


def _ints(indices: torch.Tensor) -> list[int]:
    return indices.to("cpu", torch.int64).tolist()


# kernels/jit/csrc/kvcacheio/hicache.cuh run_one / run_one_mla
def transfer_hicache_one_layer(k_cache_dst, v_cache_dst, indices_dst, k_cache_src, v_cache_src, indices_src,
                               *, element_dim=None, unroll=None, block_quota=None):
    element_dim = element_dim or k_cache_dst.size(-1)
    for dst, src in ((k_cache_dst, k_cache_src), (v_cache_dst, v_cache_src)):
        transfer_hicache_one_layer_mla(dst, indices_dst, src, indices_src, element_dim=element_dim)


def transfer_hicache_one_layer_mla(cache_dst, indices_dst, cache_src, indices_src,
                                   *, element_dim=None, unroll=None, block_quota=None):
    element_dim = element_dim or cache_dst.size(-1)
    dst = cache_dst.view(-1, element_dim)  # raises for views the kernel cannot take
    src = cache_src.view(-1, element_dim)
    dst[indices_dst.cpu()] = src[indices_src.cpu()]


# kernels/jit/csrc/kvcacheio/hicache.cuh run_all / run_all_mla: ptr[l] + index * stride
def transfer_hicache_all_layer(k_ptr_dst, v_ptr_dst, indices_dst, k_ptr_src, v_ptr_src, indices_src,
                               *, kv_cache_src_stride_bytes, kv_cache_dst_stride_bytes, element_size=None,
                               unroll=None, block_quota=None):
    for dst, src in ((k_ptr_dst, k_ptr_src), (v_ptr_dst, v_ptr_src)):
        transfer_hicache_all_layer_mla(dst, indices_dst, src, indices_src,
                                       cache_src_stride_bytes=kv_cache_src_stride_bytes,
                                       cache_dst_stride_bytes=kv_cache_dst_stride_bytes,
                                       element_size=element_size)


def transfer_hicache_all_layer_mla(ptr_dst, indices_dst, ptr_src, indices_src, *, cache_src_stride_bytes,
                                   cache_dst_stride_bytes, element_size=None, unroll=None, block_quota=None):
    if element_size is None:
        assert cache_dst_stride_bytes == cache_src_stride_bytes
        element_size = cache_dst_stride_bytes
    dst_ptrs, src_ptrs = _ints(ptr_dst), _ints(ptr_src)
    for d_row, s_row in zip(_ints(indices_dst), _ints(indices_src)):
        for d_base, s_base in zip(dst_ptrs, src_ptrs):
            _memmove(d_base + d_row * cache_dst_stride_bytes, s_base + s_row * cache_src_stride_bytes, element_size)


# kernels/ops/kvcache/hicache.py staged wrappers + relayout.cuh + staged_write_back.cuh:
# token t of page p of layer l is read at ptr[l] + (src_indices[p * page] + t) * src_stride
# (patched; element_size before), then each page is copied to host row dst_indices[p * page].
def _staged(pairs, src_indices, dst_indices, page_size, src_stride_bytes):
    src_pages = _ints(src_indices[::page_size])
    dst_rows = _ints(dst_indices)
    assert dst_indices.device.type == "cpu", "the staged kernel takes host indices on the CPU"
    for ptr_src, dst in pairs:
        layers = dst.shape[1]
        row = dst[0, 0].numel() * dst.element_size()
        stride = src_stride_bytes or row
        srcs = _ints(ptr_src)
        assert len(srcs) == layers
        for p, src_page in enumerate(src_pages):
            host_row0 = dst_rows[p * page_size]
            for t in range(page_size):
                for layer in range(layers):
                    d_addr = dst[host_row0 + t, layer].data_ptr()
                    _memmove(d_addr, srcs[layer] + (src_page + t) * stride, row)


def transfer_hicache_all_layer_staged_lf_pf(k_ptr_src, v_ptr_src, src_indices, dst_indices, staging_k, staging_v,
                                            dst_k, dst_v, *, page_size, src_stride_bytes=None, element_size=None,
                                            unroll=None, block_quota=None):
    _staged(((k_ptr_src, dst_k), (v_ptr_src, dst_v)), src_indices, dst_indices, page_size, src_stride_bytes)


def transfer_hicache_all_layer_mla_staged_lf_pf(ptr_src, src_indices, dst_indices, staging, dst, *, page_size,
                                                src_stride_bytes=None, element_size=None, unroll=None,
                                                block_quota=None):
    _staged(((ptr_src, dst),), src_indices, dst_indices, page_size, src_stride_bytes)


# kernels/jit/csrc/kvcacheio/transfer_mamba.cuh (patched; slot stride = item_size before)
def transfer_kv_mamba_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim,
                            num_warps_per_item=32, dst_slot_stride=None):
    assert item_size % 16 == 0, "transfer_mamba: item_size must be 16-byte aligned (uint4)"
    assert src_indices.device.type == dst_indices.device.type
    stride = dst_slot_stride or item_size
    for s_row, d_row in zip(_ints(src_indices), _ints(dst_indices)):
        _memmove(dst.data_ptr() + d_row * stride,
                 src.data_ptr() + s_row * src_layout_dim + layer_id * item_size, item_size)


def transfer_kv_mamba_lf_pf(src_ptrs, dst, src_indices, dst_indices, item_size, dst_layout_dim, num_layers,
                            num_warps_per_item=32, src_slot_stride=None):
    assert item_size % 16 == 0, "transfer_mamba: item_size must be 16-byte aligned (uint4)"
    assert src_indices.device.type == dst_indices.device.type
    stride = src_slot_stride or item_size
    layers = _ints(src_ptrs)
    assert len(layers) == num_layers
    for s_row, d_row in zip(_ints(src_indices), _ints(dst_indices)):
        for layer, base in enumerate(layers):
            _memmove(dst.data_ptr() + d_row * dst_layout_dim + layer * item_size,
                     base + s_row * stride, item_size)


# sgl_kernel.kvcacheio direct kernels (transfer.cu): Tensor.copy_ over index runs.
def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    s, d = src_indices.cpu(), dst_indices.cpu()
    for src, dst in zip(src_layers, dst_layers):
        dst[d] = src[s]


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    layers = len(src_ptrs) // len(dst_ptrs)
    s, d = _ints(src_indices), _ints(dst_indices)
    for group, dst in enumerate(dst_ptrs):
        for i in range(0, len(s), page_size):
            for layer in range(layers):
                src = src_ptrs[group * layers + layer]
                dst[d[i] // page_size][layer].copy_(src[s[i]: s[i] + page_size].reshape(dst[0][0].shape))


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    s, d = _ints(src_indices), _ints(dst_indices)
    for src, dst in zip(src_ptrs, dst_ptrs):
        for i in range(0, len(s), page_size):
            dst[d[i]: d[i] + page_size].copy_(src[s[i] // page_size][layer_id].reshape(dst[d[i]: d[i] + page_size].shape))


def install(monkeypatch, *modules):
    """Point every transfer name the host-pool modules use at these emulators.

    On a machine without CUDA, SGLang never imports the sgl_kernel names (hence
    raising=False) and cannot compile the JIT ones; it also reports no CUDA, so the
    host pools are told they run on CUDA, which is what they would see on a GPU.
    """
    names = {
        "jit_transfer_hicache_one_layer": transfer_hicache_one_layer,
        "jit_transfer_hicache_one_layer_mla": transfer_hicache_one_layer_mla,
        "jit_transfer_hicache_all_layer": transfer_hicache_all_layer,
        "jit_transfer_hicache_all_layer_mla": transfer_hicache_all_layer_mla,
        "jit_transfer_hicache_all_layer_staged_lf_pf": transfer_hicache_all_layer_staged_lf_pf,
        "jit_transfer_hicache_all_layer_mla_staged_lf_pf": transfer_hicache_all_layer_mla_staged_lf_pf,
        "transfer_kv_mamba_pf_lf": transfer_kv_mamba_pf_lf,
        "transfer_kv_mamba_lf_pf": transfer_kv_mamba_lf_pf,
        "transfer_kv_direct": transfer_kv_direct,
        "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
        "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    }
    for module in modules:
        for name, fn in names.items():
            monkeypatch.setattr(module, name, fn, raising=False)
        monkeypatch.setattr(module, "_is_cuda", True, raising=False)
        for gate in ("can_use_hicache_jit_kernel", "can_use_write_back_jit_kernel"):
            if hasattr(module, gate):
                monkeypatch.setattr(module, gate, lambda **kwargs: True)

