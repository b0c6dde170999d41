"""Launch geometry of the JIT HiCache copy kernels (patch 0008), without a GPU.

A worker of 32 / unroll lanes carries one element (a token's row of one layer), so each
lane holds element_size * unroll / 32 bytes: the reads in flight per lane. Loads from
pinned host memory are bound by that; the H200 benchmark (bench/RESULTS.md) shows
SGLang's 36 bytes per lane for 1,152-byte MLA rows loading at 70% of the link, 72 at
92%. The block quota, and so the GPU's share, must not change. Nor may a small batch
get fewer blocks than SGLang 0.5.20 launched for it: wider workers fill a block with
fewer rows, and one 64-token page of MLA rows in one block instead of two took 20% longer.
"""
from __future__ import annotations

import pytest
import torch

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


# hicache.cuh, run_one/run_all: kWorkersPerBlock = kBlockSize / (kWarpThreads / kUnroll),
# num_blocks = min(div_ceil(length, kWorkersPerBlock), kBlockQuota); kBlockSize is 1024.
def launched_blocks(num_elements, unroll, quota=2):
    workers_per_block = 1024 // (32 // unroll)
    return min(-(-num_elements // workers_per_block), quota)


def sglang_0_5_20_unroll(element_size):
    return 4 if element_size <= 512 else 2 if element_size <= 1024 else 1


@pytest.fixture
def launched(kernel_emulation, hicache):
    """The unroll of each launch of the emulated JIT kernels (the module's template argument)."""
    return lambda: [launch.template[1] for launch in kernel_emulation.recorder.launches]


@pytest.mark.parametrize("element_size", ROW_SIZES)
def test_a_batch_never_gets_fewer_blocks_than_in_sglang(hicache, element_size):
    native, wide = sglang_0_5_20_unroll(element_size), hicache._default_unroll(element_size)
    for num_elements in (1, 16, 32, 33, 48, 64, 65, 96, 128, 129, 256, 1024, 65536):
        unroll = hicache._unroll_for_batch(element_size, num_elements, 2)
        assert unroll in (native, wide), num_elements
        assert launched_blocks(num_elements, unroll) >= launched_blocks(num_elements, native), num_elements
        if launched_blocks(num_elements, wide) >= launched_blocks(num_elements, native):
            assert unroll == wide, num_elements  # the wider lanes wherever they cost no block


def layer_tables(layers, rows, row_bytes):
    """Pointer tables over real per-layer buffers: the kernels copy through them."""
    buffers = [torch.zeros(rows, row_bytes, dtype=torch.uint8) for _ in range(layers)]
    return buffers, torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)


def one_layer_mla(hicache, n):
    rows = torch.zeros(256, 1, 576, dtype=torch.bfloat16)
    index = torch.arange(n) % 256
    hicache.transfer_hicache_one_layer_mla(cache_dst=rows, indices_dst=index, cache_src=rows.clone(),
                                           indices_src=index)


def all_layer_mla(hicache, n):
    index = torch.arange(n) % 256
    src, src_ptrs = layer_tables(2, 256, 1152)
    dst, dst_ptrs = layer_tables(2, 256, 1152)
    hicache.transfer_hicache_all_layer_mla(ptr_dst=dst_ptrs, indices_dst=index, ptr_src=src_ptrs, indices_src=index,
                                           cache_src_stride_bytes=1152, cache_dst_stride_bytes=1152,
                                           element_size=1152)


@pytest.mark.parametrize("transfer", [one_layer_mla, all_layer_mla])
def test_mla_transfers_pick_the_unroll_by_batch(hicache, launched, transfer):
    transfer(hicache, 64)  # one page: two blocks of 32 workers, as in SGLang 0.5.20
    transfer(hicache, 4096)  # 72 bytes per lane
    assert launched() == [1, 2]


def test_mha_transfers_keep_sglangs_unroll_at_every_batch(hicache, launched):
    rows = torch.zeros(256, 4, 128, dtype=torch.bfloat16)
    _, src = layer_tables(2, 256, 1024)
    _, dst = layer_tables(2, 256, 1024)
    for n in (64, 4096):
        index = torch.arange(n) % 256
        hicache.transfer_hicache_one_layer(rows, rows, index, rows.clone(), rows.clone(), index, element_dim=512)
        hicache.transfer_hicache_all_layer(dst, dst, index, src, src, index,
                                           kv_cache_src_stride_bytes=1024, kv_cache_dst_stride_bytes=1024)
    assert launched() == [2, 2, 2, 2]


@pytest.mark.parametrize("element_size,unrolls", [(1152, [1, 2]), (1024, [2]), (640, [2, 4]), (4096, [1])])
def test_every_unroll_a_batch_may_pick_is_built_at_start_up(hicache, kernel_emulation, element_size, unrolls):
    assert hicache.can_use_hicache_jit_kernel(element_size=element_size)
    built = [args for name, args in kernel_emulation.recorder.builds if name == "hicache"]
    assert sorted(int(unroll) for _, unroll, _, _ in built) == unrolls
    # element size, unroll, block quota, and the block size the launch geometry assumes
    assert {(int(size), int(quota), int(threads)) for size, _, quota, threads in built} == {(element_size, 2, 1024)}


@pytest.mark.parametrize("element_size", [512, 1152, 2048])
def test_launches_get_the_blocks_sglang_gave_them(hicache, kernel_emulation, element_size):
    """The grid each launch gets (kernel arithmetic, emulated) never shrinks below 0.5.20's."""
    rows = torch.zeros(4096, element_size // 2, dtype=torch.bfloat16)
    for n in (1, 32, 64, 65, 128, 4096):
        index = torch.arange(n)
        hicache.transfer_hicache_one_layer_mla(cache_dst=rows, indices_dst=index, cache_src=rows.clone(),
                                               indices_src=index)
        launch = kernel_emulation.recorder.launches[-1]
        assert launch.blocks >= launched_blocks(n, sglang_0_5_20_unroll(element_size)), (n, launch)
