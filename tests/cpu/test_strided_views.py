"""How the host pools tell strided device views from dense ones (pool_host/base.py).

One mechanism serves the MHA and MLA host pools (the Mamba host pool has its own, for
slots): from the views alone, the row stride every layer shares (kvcached's interleaved
buffers: one record per token), runs of host layers by stride (a packed MTP draft pool
has its own), nothing at all for dense views (SGLang's own path), and a refusal for
views no copy kernel can step through. These tests give it the geometries it must tell
apart, including ones a device pool should never hand out. On SGLang 0.5.20 these names
do not exist.
"""
from __future__ import annotations

import pytest
import torch

LAYERS, TOKENS, HEADS, DIM = 3, 16, 2, 64
ROW = HEADS * DIM * 2  # bytes of one bf16 row


def interleaved(layers=LAYERS, dtype=torch.bfloat16):
    """kvcached's contiguous layout: every layer's K and V of a token in one record;
    returns the per-layer (K, V) views and the record's bytes."""
    whole = torch.zeros(TOKENS, layers, 2, HEADS, DIM, dtype=dtype)
    return [(whole[:, l, 0], whole[:, l, 1]) for l in range(layers)], layers * 2 * ROW


def dense(layers=LAYERS):
    return [tuple(torch.zeros(TOKENS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(2)) for _ in range(layers)]


def host(host_modules):
    """A host pool as SGLang's unit tests build one: __new__ and attributes."""
    pool = host_modules.mha.MHATokenToKVPoolHost.__new__(host_modules.mha.MHATokenToKVPoolHost)
    pool.token_stride_size = ROW
    return pool


def record(host_modules, layers, layout="page_first", jit=True):
    pool = host(host_modules)
    pool._init_device_row_stride(layers, layout, jit_copies_rows=lambda: jit)
    return pool


def test_dense_views_leave_the_host_pool_on_sglangs_path(host_modules):
    # Even where strided views are refused (page_head, no JIT kernel), dense ones pass.
    pool = record(host_modules, dense(), layout="page_head", jit=False)
    assert pool.device_rows_packed and pool.device_row_stride_bytes == ROW
    assert pool._device_row_runs is None
    # A host pool built without __init__ reads as dense too.
    assert host(host_modules).device_rows_packed


def test_one_stride_is_read_from_the_views(host_modules):
    layers, stride = interleaved()
    pool = record(host_modules, layers)
    assert not pool.device_rows_packed and pool.device_row_stride_bytes == stride
    assert pool._device_row_runs is None


def test_each_stride_gets_its_own_run_and_equal_strides_merge(host_modules):
    target, stride = interleaved()
    draft, draft_stride = interleaved(layers=1)
    # target (strided), a dense draft, two drafts of one stride: three runs
    pool = record(host_modules, [*target, *dense(1), *draft, *draft])
    assert pool._device_row_runs == ((0, LAYERS, stride), (LAYERS, LAYERS + 1, ROW),
                                     (LAYERS + 1, LAYERS + 3, draft_stride))
    assert not pool.device_rows_packed


def test_a_layer_whose_views_do_not_share_one_stride_is_refused(host_modules):
    layers, _ = interleaved()
    other, _ = interleaved(layers=LAYERS + 1)
    mixed = [(layers[0][0], other[0][1]), *layers[1:]]
    with pytest.raises(ValueError, match="KV rows of layer 0: its views do not share one row stride"):
        record(host_modules, mixed)


def test_views_whose_rows_are_not_dense_are_refused(host_modules):
    whole = torch.zeros(TOKENS, LAYERS, HEADS, 2 * DIM, dtype=torch.bfloat16)
    every_other = [(whole[:, l, :, ::2],) for l in range(LAYERS)]  # one stride, rows with gaps
    with pytest.raises(ValueError, match="do not share one row stride"):
        record(host_modules, every_other)


@pytest.mark.parametrize("layout", ["page_first_direct", "page_head", "page_first_kv_split"])
def test_strided_views_are_refused_where_sglang_kernel_copies_them_as_dense(host_modules, layout):
    layers, stride = interleaved()
    with pytest.raises(ValueError, match=f"strided \\({stride} B apart\\), which --hicache-mem-layout {layout} "
                                         "cannot copy; use --hicache-mem-layout page_first or layer_first"):
        record(host_modules, layers, layout=layout)


def test_strided_views_without_the_jit_kernel_are_refused(host_modules):
    layers, _ = interleaved()
    with pytest.raises(ValueError, match="only the JIT HiCache kernels copy"):
        record(host_modules, layers, jit=False)


def test_the_jit_gate_is_asked_only_for_strided_views(host_modules):
    asked = []
    pool = host(host_modules)
    pool._init_device_row_stride(dense(), "page_first", jit_copies_rows=lambda: asked.append(1) or True)
    assert asked == []
    pool._init_device_row_stride(interleaved()[0], "page_first", jit_copies_rows=lambda: asked.append(1) or True)
    assert asked == [1]
