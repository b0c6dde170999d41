"""How the host pools tell strided device views from dense ones (pool_host/base.py, common.py).

One mechanism serves the MHA, MLA and Mamba host pools: from the views alone, the row
stride every layer shares (kvcached's interleaved buffers: one record per token), runs
of host layers by stride (a packed MTP draft pool has its own), nothing at all for dense
views (SGLang's own path), and a refusal for views no copy kernel can step through.
These tests give it the geometries it must tell apart, including ones a device pool
should never hand out. On SGLang 0.5.20 these names do not exist.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

LAYERS, TOKENS, HEADS, DIM = 3, 16, 2, 64
ROW = HEADS * DIM * 2  # bytes of one bf16 row


@pytest.fixture
def common(host_modules):
    from sglang.srt.mem_cache.pool_host import common

    return common


def interleaved(kinds=2, layers=LAYERS, dtype=torch.bfloat16):
    """kvcached's contiguous layout: every layer and kind of a token in one record."""
    whole = torch.zeros(TOKENS, layers, kinds, HEADS, DIM, dtype=dtype)
    return [[whole[:, l, k] for l in range(layers)] for k in range(kinds)], layers * kinds * ROW


def dense(layers=LAYERS, tokens=TOKENS):
    return [torch.zeros(tokens, HEADS, DIM, dtype=torch.bfloat16) for _ in range(layers)]


def host_pool(host_modules, layout="page_first", can_use_jit=True):
    """An MHA host pool built as SGLang's unit tests build one: __new__ and attributes."""
    host = host_modules.mha.MHATokenToKVPoolHost.__new__(host_modules.mha.MHATokenToKVPoolHost)
    host.layout, host.can_use_jit, host.token_stride_size = layout, can_use_jit, ROW
    host.device_pool = SimpleNamespace(device="cpu")
    return host


def test_a_dense_or_strided_view_gives_its_row_stride(common):
    assert common.device_row_stride_bytes(dense(), "x") == ROW
    (k, v), stride = interleaved()
    assert common.device_row_stride_bytes(k + v, "x") == stride
    # Views with one row or none may sit beside strided ones: a row's own layout decides.
    assert common.device_row_stride_bytes(k + [k[0][:0], k[1][:1]], "x") == stride


def test_views_without_one_stride_are_refused_naming_the_pool(common):
    (k, _), _ = interleaved()
    (other, _), _ = interleaved(layers=LAYERS + 1)
    with pytest.raises(ValueError, match="cannot copy the MHA pool: .* without one common row stride"):
        common.device_row_stride_bytes(k + other[:1], "the MHA pool")


def test_views_whose_rows_are_not_dense_are_refused(common):
    whole = torch.zeros(TOKENS, LAYERS, HEADS, 2 * DIM, dtype=torch.bfloat16)
    every_other = [whole[:, l, :, ::2] for l in range(LAYERS)]  # one stride, rows with gaps
    with pytest.raises(ValueError, match="rows not dense"):
        common.device_row_stride_bytes(every_other, "x")


def test_dense_views_leave_the_host_pool_on_sglangs_path(host_modules):
    host = host_pool(host_modules, layout="page_head", can_use_jit=False)  # what strided views refuse
    host._init_device_row_strides([(dense(), dense())], "MHA KV")
    assert host.device_layer_runs is None
    tables = (torch.tensor([1]), torch.tensor([2]))
    [run] = host._all_layer_copy_runs(tables)
    assert run.layers == slice(None) and run.ptrs is tables and run.row_stride_bytes == ROW


def test_each_stride_gets_its_own_run_of_host_layers(host_modules):
    (k, v), stride = interleaved()
    (dk, dv), draft_stride = interleaved(layers=1)
    host = host_pool(host_modules)
    # target (strided), a dense draft, two drafts of one stride: three runs
    host._init_device_row_strides([(k, v), (dense(1), dense(1)), (dk, dv), (dk, dv)], "MHA KV")
    runs = host.device_layer_runs
    assert [(r.layers, r.row_stride_bytes) for r in runs] == [
        (slice(0, LAYERS), stride), (slice(LAYERS, LAYERS + 1), ROW), (slice(LAYERS + 1, LAYERS + 3), draft_stride)]
    assert host._all_layer_copy_runs((None, None)) is runs
    assert [table.tolist() for table in runs[2].ptrs] == [[dk[0].data_ptr()] * 2, [dv[0].data_ptr()] * 2]
    assert all(table.dtype == torch.uint64 for run in runs for table in run.ptrs)
    with pytest.raises(dataclasses.FrozenInstanceError):  # built once, at startup
        runs[0].row_stride_bytes = 0


@pytest.mark.parametrize("layout", ["page_first_direct", "page_head"])
def test_strided_views_are_refused_where_sglang_kernel_copies_them_as_dense(host_modules, layout):
    (k, v), _ = interleaved()
    with pytest.raises(ValueError, match=f"--hicache-mem-layout {layout} has no copy path.*"
                                         "Use --hicache-mem-layout layer_first or page_first.*"
                                         "KVCACHED_CONTIGUOUS_LAYOUT=false"):
        host_pool(host_modules, layout=layout)._init_device_row_strides([(k, v)], "MHA KV")


def test_strided_views_without_the_jit_kernel_are_refused(host_modules):
    (k, v), _ = interleaved()
    with pytest.raises(ValueError, match="JIT HiCache kernel, which is unavailable"):
        host_pool(host_modules, can_use_jit=False)._init_device_row_strides([(k, v)], "MHA KV")
