"""Launch geometry of the JIT HiCache copy kernels (patch 0008), without a GPU.

A worker of 32 / unroll lanes carries one element (a token's row of one layer), so each
lane holds element_size * unroll / 32 bytes: the reads in flight per lane. Loads from
pinned host memory are bound by that; the H200 benchmark (bench/RESULTS.md) shows
SGLang's 36 bytes per lane for 1,152-byte MLA rows loading at 70% of the link, 72 at
92%. The block quota, and so the GPU's share, must not change.
"""
from __future__ import annotations

import pytest

ROW_SIZES = range(128, 8192 + 1, 128)  # the JIT kernel takes rows that are multiples of 128 B


@pytest.fixture
def hicache():
    from sglang.kernels.ops.kvcache import hicache

    return hicache


@pytest.mark.parametrize("element_size", ROW_SIZES)
def test_every_lane_carries_at_least_64_bytes_where_it_can(hicache, element_size):
    unroll = hicache._default_unroll(element_size)
    assert unroll in (1, 2, 4) and 32 % unroll == 0 and 128 % (32 // unroll) == 0  # the kernel's constraints
    per_lane = element_size * unroll // 32
    assert per_lane >= 64 or unroll == 4  # 4 is the widest worker the kernel has
    assert unroll == 1 or element_size * (unroll // 2) < 64 * 32  # the smallest unroll that gets there


@pytest.mark.parametrize("element_size,unroll", [(512, 4), (1024, 2), (2048, 1), (4096, 1), (256, 4)])
def test_power_of_two_rows_keep_sglangs_unroll(hicache, element_size, unroll):
    assert hicache._default_unroll(element_size) == unroll


def test_mla_rows_get_unroll_2(hicache):
    assert hicache._default_unroll(576 * 2) == 2  # DeepSeek-V2/V3 bf16: 72 bytes per lane


def test_block_quota_unchanged(hicache):
    assert hicache.DEFAULT_BLOCK_QUOTA == 2  # CUDA: the copies take two SMs from the model, as in 0.5.20
