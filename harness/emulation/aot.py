"""sglang-kernel's AOT KV-cache copies (``sgl_kernel.kvcacheio``), emulated on CPU.

SGLang's wheel does not carry them: the host pools import them from sglang-kernel when
CUDA is present, so they are emulated at the names the host pools import. Source:
upstream SGLang's kvcacheio/transfer.cu (python/sglang/kernels/aot/csrc, formerly
sgl-kernel/csrc) and sgl_kernel/kvcacheio.py, as of the sglang-kernel releases that
SGLang 0.5.20 pins (0.4.7):

* the ``transfer_kv_*`` warp kernels (transfer_kv_launcher): per index and layer, copy
  ``item_size`` bytes between addresses given by an offset function of the layout
  (layer first, page first, a pointer table per layer, page head), with the
  launcher's TORCH_CHECKs;
* ``transfer_kv_direct``: ``Tensor.copy_`` over runs of consecutive indices (it honours
  any view's strides);
* ``transfer_kv_*_direct_*`` (page_first_direct): raw page copies, as the CUDA >= 12.8
  build issues them through cudaMemcpyBatchAsync (the official CUDA 13 image's path):
  ``page_size * stride(0)`` bytes from ``data_ptr() + index * stride(0)``, which is
  right only for views whose rows are back to back.
"""
from __future__ import annotations

import torch

from harness.emulation.memory import KernelError, Region, as_int, check, copy, ints, table


def _indices(src_indices, dst_indices):
    check(src_indices.dtype == torch.int64, "Source indices must be of type long")
    check(dst_indices.dtype == torch.int64, "Destination indices must be of type long")
    check(src_indices.numel() == dst_indices.numel(), "Source and destination indices must have the same length")
    if src_indices.numel() == 0:
        # items_per_warp = div_up(0, ...) = 0, then div_up(num_items, 0): an integer division by zero.
        raise KernelError("transfer_kv_launcher: no indices (integer division by zero in the launcher)")
    return ints(src_indices), ints(dst_indices)


# Offset functions of transfer.cu, in bytes; `base` is a Region, `tbl` a list of Regions.
def lf(base, tbl, layer, layer_dim, page, item):
    return base, layer * layer_dim + page * item


def pf(base, tbl, layer, page_dim, page, item):
    return base, page * page_dim + layer * item


def lf_tbl(base, tbl, layer, _dim, page, item):
    return tbl[layer], page * item


def per_head_lf(base, tbl, layer, layer_dim, page, item, head, heads, page_size):
    return base, layer * layer_dim + page * item + item // heads * head


def per_head_lf_tbl(base, tbl, layer, _dim, page, item, head, heads, page_size):
    return tbl[layer], page * item + item // heads * head


def ph(base, tbl, layer, page_dim, page, item, head, heads, page_size):
    # page head layout: [page_num, head_num, page_size, layer_num, head_dim]
    return base, (page // page_size * page_size * page_dim + page_dim // heads * head * page_size
                  + page % page_size * page_dim // heads + layer * item // heads)


def _launch(src_fn, dst_fn, *, src_k=None, dst_k=None, src_v=None, dst_v=None, src_indices, dst_indices,
            start_layer, num_layers, item_size, src_dim=0, dst_dim=0, src_k_tbl=None, dst_k_tbl=None,
            src_v_tbl=None, dst_v_tbl=None, mla=False, page_head=None):
    """transfer_kv_launcher + transfer_kernel_impl / transfer_page_head_kernel_impl."""
    src_rows, dst_rows = _indices(src_indices, dst_indices)
    item_size = as_int("item_size", item_size)
    check(item_size % 8 == 0, "Item byte size must be divisible by 8")
    region = lambda t, what: None if t is None else Region.of_tensor(t, what)
    sides = [(region(src_k, "src_k"), src_k_tbl, region(dst_k, "dst_k"), dst_k_tbl)]
    if not mla:
        sides.append((region(src_v, "src_v"), src_v_tbl, region(dst_v, "dst_v"), dst_v_tbl))
    heads, page_size = (1, 1) if page_head is None else page_head
    extra = () if page_head is None else (page_size,)
    span = item_size // heads
    for s, d in zip(src_rows, dst_rows):
        for layer in range(start_layer, start_layer + num_layers):
            for src_base, src_tbl, dst_base, dst_tbl in sides:
                for head in range(heads):
                    head_args = () if page_head is None else (head, heads)
                    src, src_off = src_fn(src_base, src_tbl, layer, src_dim, s, item_size, *head_args, *extra)
                    dst, dst_off = dst_fn(dst_base, dst_tbl, layer, dst_dim, d, item_size, *head_args, *extra)
                    copy(dst, dst_off, src, src_off, span)


def _layers_check(num_layers, layers_tensor, what="k"):
    num_layers = as_int("num_layers", num_layers)
    check(num_layers == layers_tensor.size(0),
          f"Number of layers in source {what} tensor does not match num_layers")
    return num_layers


def transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size, block_quota=2,
                          num_warps_per_block=32):
    _launch(lf, lf, src_k=src_k, dst_k=dst_k, src_v=src_v, dst_v=dst_v, src_indices=src_indices,
            dst_indices=dst_indices, start_layer=0, num_layers=1, item_size=item_size)


def transfer_kv_per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                                src_layout_dim, block_quota=2, num_warps_per_block=32):
    _launch(pf, lf, src_k=src_k, dst_k=dst_k, src_v=src_v, dst_v=dst_v, src_indices=src_indices,
            dst_indices=dst_indices, start_layer=as_int("layer_id", layer_id), num_layers=1, item_size=item_size,
            src_dim=as_int("src_layout_dim", src_layout_dim))


def transfer_kv_per_layer_ph_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, layer_id, item_size,
                                src_layout_dim, page_size, head_num, block_quota=2, num_warps_per_block=32):
    _launch(ph, per_head_lf, src_k=src_k, dst_k=dst_k, src_v=src_v, dst_v=dst_v, src_indices=src_indices,
            dst_indices=dst_indices, start_layer=as_int("layer_id", layer_id), num_layers=1, item_size=item_size,
            src_dim=as_int("src_layout_dim", src_layout_dim),
            page_head=(as_int("head_num", head_num), as_int("page_size", page_size)))


def transfer_kv_all_layer(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices, dst_indices,
                          item_size, num_layers, block_quota=2, num_warps_per_block=32):
    n = _layers_check(num_layers, src_k_layers)
    _launch(lf_tbl, lf_tbl, src_indices=src_indices, dst_indices=dst_indices, start_layer=0, num_layers=n,
            item_size=item_size, src_k_tbl=table("src_k_layers", src_k_layers, n),
            dst_k_tbl=table("dst_k_layers", dst_k_layers, n), src_v_tbl=table("src_v_layers", src_v_layers, n),
            dst_v_tbl=table("dst_v_layers", dst_v_layers, n))


def transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                                dst_layout_dim, num_layers, block_quota=2, num_warps_per_block=32):
    n = _layers_check(num_layers, src_k_layers)
    _launch(lf_tbl, pf, dst_k=dst_k, dst_v=dst_v, src_indices=src_indices, dst_indices=dst_indices,
            start_layer=0, num_layers=n, item_size=item_size, dst_dim=as_int("dst_layout_dim", dst_layout_dim),
            src_k_tbl=table("src_k_layers", src_k_layers, n), src_v_tbl=table("src_v_layers", src_v_layers, n))


def transfer_kv_all_layer_lf_ph(src_k_layers, dst_k, src_v_layers, dst_v, src_indices, dst_indices, item_size,
                                dst_layout_dim, num_layers, page_size, head_num, block_quota=2,
                                num_warps_per_block=32):
    n = _layers_check(num_layers, src_k_layers)
    _launch(per_head_lf_tbl, ph, dst_k=dst_k, dst_v=dst_v, src_indices=src_indices, dst_indices=dst_indices,
            start_layer=0, num_layers=n, item_size=item_size, dst_dim=as_int("dst_layout_dim", dst_layout_dim),
            src_k_tbl=table("src_k_layers", src_k_layers, n), src_v_tbl=table("src_v_layers", src_v_layers, n),
            page_head=(as_int("head_num", head_num), as_int("page_size", page_size)))


def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size, block_quota=2,
                              num_warps_per_block=32):
    _launch(lf, lf, src_k=src, dst_k=dst, src_indices=src_indices, dst_indices=dst_indices, start_layer=0,
            num_layers=1, item_size=item_size, mla=True)


def transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size, src_layout_dim,
                                    block_quota=2, num_warps_per_block=32):
    _launch(pf, lf, src_k=src, dst_k=dst, src_indices=src_indices, dst_indices=dst_indices,
            start_layer=as_int("layer_id", layer_id), num_layers=1, item_size=item_size,
            src_dim=as_int("src_layout_dim", src_layout_dim), mla=True)


def transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers,
                              block_quota=2, num_warps_per_block=32):
    n = _layers_check(num_layers, src_layers, "")
    _launch(lf_tbl, lf_tbl, src_indices=src_indices, dst_indices=dst_indices, start_layer=0, num_layers=n,
            item_size=item_size, src_k_tbl=table("src_layers", src_layers, n),
            dst_k_tbl=table("dst_layers", dst_layers, n), mla=True)


def transfer_kv_all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size, dst_layout_dim,
                                    num_layers, block_quota=2, num_warps_per_block=32):
    n = _layers_check(num_layers, src_layers, "")
    _launch(lf_tbl, pf, dst_k=dst, src_indices=src_indices, dst_indices=dst_indices, start_layer=0, num_layers=n,
            item_size=item_size, dst_dim=as_int("dst_layout_dim", dst_layout_dim),
            src_k_tbl=table("src_layers", src_layers, n), mla=True)


def _tensors(name, values):
    check(isinstance(values, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in values),
          f"{name}: expected a list of tensors")
    return list(values)


def _int64s(indices):
    # indices.cpu().data_ptr<int64_t>(): any other dtype fails the scalar-type check.
    check(indices.dtype == torch.int64, f"expected scalar type Long but found {indices.dtype}")
    return ints(indices.cpu())


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    src_layers, dst_layers = _tensors("src_layers", src_layers), _tensors("dst_layers", dst_layers)
    check(len(src_layers) == len(dst_layers), "Source and destination layers must have the same number of layers")
    check(src_indices.numel() == dst_indices.numel(), "Source and destination indices must have the same length")
    page_size = as_int("page_size", page_size)
    check(page_size > 0, "Page size must be positive")
    check(src_indices.numel() % page_size == 0, "Source indices size must be divisible by page size")
    s, d = _int64s(src_indices), _int64s(dst_indices)
    start = 0
    for i in range(len(s)):
        if i < len(s) - 1 and s[i + 1] - s[i] == 1 and d[i + 1] - d[i] == 1:
            continue
        count = i + 1 - start
        for src, dst in zip(src_layers, dst_layers):  # transfer_page_direct: slice(0) + copy_
            dst[d[start]: d[start] + count].copy_(src[s[start]: s[start] + count])
        start = i + 1


def _page_first_direct(src_ptrs, dst_ptrs, src_indices, dst_indices, start_layer, page_size, lf_to_pf):
    """transfer_kv_page_first_direct_impl, cudaMemcpyBatchAsync branch."""
    src_ptrs, dst_ptrs = _tensors("src_ptrs", src_ptrs), _tensors("dst_ptrs", dst_ptrs)
    check(src_indices.numel() == dst_indices.numel(), "Source and destination indices must have the same length")
    page_size = as_int("page_size", page_size)
    check(page_size > 0, "Page size must be positive")
    check(src_indices.numel() % page_size == 0, "Source indices size must be divisible by page size")
    s, d = _int64s(src_indices), _int64s(dst_indices)
    pages = len(s) // page_size
    per_layer, paged = (src_ptrs, dst_ptrs) if lf_to_pf else (dst_ptrs, src_ptrs)
    mla = len(paged) == 1
    layers = len(per_layer) if mla else len(per_layer) // 2
    elem = paged[0].element_size()
    # Strides are read from the first tensor of each side and used for every tensor.
    layer_stride0 = per_layer[0].stride(0) * elem
    paged_stride0, paged_stride1 = paged[0].stride(0) * elem, paged[0].stride(1) * elem
    nbytes = page_size * layer_stride0
    layer_regions = [Region.of_tensor(t, "layer view") for t in per_layer]
    paged_regions = [Region.of_tensor(t, "page-first buffer") for t in paged]
    for i in range(pages):
        layer_row = s[i * page_size] if lf_to_pf else d[i * page_size]
        page = (d if lf_to_pf else s)[i * page_size] // page_size
        for j in range(layers):
            for kv in range(1 if mla else 2):
                layer_side = layer_regions[j + kv * layers], layer_row * layer_stride0
                paged_side = paged_regions[kv], page * paged_stride0 + (start_layer + j) * paged_stride1
                (dst, dst_off), (src, src_off) = (paged_side, layer_side) if lf_to_pf else (layer_side, paged_side)
                copy(dst, dst_off, src, src_off, nbytes)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id, page_size):
    _page_first_direct(src_ptrs, dst_ptrs, src_indices, dst_indices, as_int("layer_id", layer_id), page_size,
                       lf_to_pf=False)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    _page_first_direct(src_ptrs, dst_ptrs, src_indices, dst_indices, 0, page_size, lf_to_pf=True)


KVCACHEIO = {fn.__name__: fn for fn in (
    transfer_kv_per_layer, transfer_kv_per_layer_pf_lf, transfer_kv_per_layer_ph_lf, transfer_kv_all_layer,
    transfer_kv_all_layer_lf_pf, transfer_kv_all_layer_lf_ph, transfer_kv_per_layer_mla,
    transfer_kv_per_layer_mla_pf_lf, transfer_kv_all_layer_mla, transfer_kv_all_layer_mla_lf_pf,
    transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf, transfer_kv_all_layer_direct_lf_pf,
)}
