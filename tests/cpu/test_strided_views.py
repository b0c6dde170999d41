"""How the host pools tell strided device views from dense ones (pool_host/common.py).

One mechanism serves the MHA, MLA and Mamba host pools: from the views alone, a common
row stride (kvcached's interleaved buffers), None for dense views (SGLang's own path),
and a refusal for views no copy kernel can step through. These tests give it the
geometries it must tell apart, including the ones a device pool should never hand out.
On SGLang 0.5.20 these functions do not exist.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

LAYERS, TOKENS, HEADS, DIM = 3, 16, 2, 64


@pytest.fixture
def common(host_modules):
    from sglang.srt.mem_cache.pool_host import common

    return common


def interleaved(kinds=2, layers=LAYERS, dtype=torch.bfloat16):
    """kvcached's contiguous layout: every layer and kind of a token in one record."""
    whole = torch.zeros(TOKENS, layers, kinds, HEADS, DIM, dtype=dtype)
    return [[whole[:, l, k] for l in range(layers)] for k in range(kinds)], layers * kinds * HEADS * DIM * 2


def test_dense_views_keep_sglangs_path(common):
    dense = [torch.zeros(TOKENS, HEADS, DIM) for _ in range(LAYERS)]
    assert common.device_view_stride_bytes(dense, "x") is None
    assert common.find_strided_device_layers([(dense, dense)], "cpu", "x") is None


def test_interleaved_views_give_their_record_as_the_stride(common):
    (k, v), stride = interleaved()
    assert common.device_view_stride_bytes(k + v, "x") == stride
    # Views with one row or none may sit beside strided ones (a row's own layout decides).
    assert common.device_view_stride_bytes(k + [k[0][:0], k[1][:1]], "x") == stride


def test_views_without_one_stride_are_refused(common):
    (k, _), _ = interleaved()
    (other, _), _ = interleaved(layers=LAYERS + 1)
    with pytest.raises(ValueError, match="one common row stride"):
        common.device_view_stride_bytes(k + other[:1], "x")
    # The refusal names the pool it is about.
    with pytest.raises(ValueError, match="cannot copy the MHA device KV pool"):
        common.find_strided_device_layers([(k, other[:1])], "cpu", "the MHA device KV pool")


def test_views_whose_rows_are_not_dense_are_refused(common):
    whole = torch.zeros(TOKENS, LAYERS, HEADS, 2 * DIM, dtype=torch.bfloat16)
    every_other = [whole[:, l, :, ::2] for l in range(LAYERS)]  # one stride, rows with gaps
    with pytest.raises(ValueError, match="rows not dense"):
        common.device_view_stride_bytes(every_other, "x")


def test_each_device_pool_gets_its_own_run_of_host_layers(common):
    (k, v), stride = interleaved()
    draft = [torch.zeros(TOKENS, HEADS, DIM, dtype=torch.bfloat16)]  # a dense pool beside a strided one
    (dk, dv), draft_stride = interleaved(layers=1)
    runs = common.find_strided_device_layers([(k, v), (draft, draft), (dk, dv)], "cpu", "x")
    assert [(r.host_layer_start, r.layer_num, r.stride_bytes) for r in runs] == [
        (0, LAYERS, stride), (LAYERS, 1, HEADS * DIM * 2), (LAYERS + 1, 1, draft_stride)]
    assert [r.host_layers for r in runs] == [slice(0, LAYERS), slice(LAYERS, LAYERS + 1),
                                             slice(LAYERS + 1, LAYERS + 2)]
    with pytest.raises(dataclasses.FrozenInstanceError):  # built once, at startup
        runs[0].stride_bytes = 0
    for run, buffers in zip(runs, [(k, v), (draft, draft), (dk, dv)]):
        assert len(run.ptr_tables) == 2
        for table, views in zip(run.ptr_tables, buffers):
            assert table.dtype == torch.uint64
            assert table.tolist() == [view.data_ptr() for view in views]


def test_a_dense_pool_steps_by_its_row_size_however_few_rows_it_has(common):
    """A dense pool's stride is the size of one row, read from its first row: a pool of
    one row beside strided ones is served like any other."""
    (k, v), stride = interleaved()
    one_row = [torch.zeros(1, HEADS, DIM, dtype=torch.bfloat16)]
    runs = common.find_strided_device_layers([(k, v), (one_row, one_row)], "cpu", "x")
    assert [r.stride_bytes for r in runs] == [stride, HEADS * DIM * 2]
