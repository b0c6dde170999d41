"""Backup and load through SGLang's HybridCacheController over real kvcached pools.

The stack is built by SGLang's own assembler functions from a ServerArgs parsed from
`--enable-hierarchical-cache` (SGLang's defaults: page_first, kernel, write_through) or
with `--hicache-mem-layout layer_first`; trips go through the controller's write, load
and start_loading on its own CUDA streams, with the real JIT kernels
(tests/support/controller.py). The hybrid case is Qwen3.5-4B whole: its 8 full-attention
layers in an elastic MHA pool and its 24 GDN layers in an elastic Mamba pool, backed up
and loaded together, 32 transfer layers.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.runtime_context import reset_context
from harness.emulation.allocators import PageAllocator, SlotAllocator
from tests.gpu.conftest import record
from tests.gpu.pools import PAGE, gdn_pool, mha_pool, mla_pool_of_its_own
from tests.support import controller as ctl
from harness.models import DEEPSEEK_V2_LITE, QWEN25_7B, QWEN35_4B
from tests.support.roundtrip import fill_random, mamba_families, mha_families, mla_families, pages_to_rows, poison

LAYOUT_FLAGS = {"page_first": (), "layer_first": ("--hicache-mem-layout", "layer_first")}


@pytest.fixture
def controller_trips(trips):
    yield max(trips // 5, 20)  # each trip waits on the controller's streams
    reset_context()


def kv_pool(kind, layers=None):
    if kind == "MLA":
        return mla_pool_of_its_own(DEEPSEEK_V2_LITE)
    return mha_pool(QWEN25_7B if kind == "MHA" else QWEN35_4B, layers)


def run(kind, host_layout, trips, mamba=None, full_layers=None, linear_layers=()):
    ctl.publish_server_args(*LAYOUT_FLAGS[host_layout])
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    pool = kv_pool(kind, len(full_layers) if full_layers else None)
    pages = sorted(pool.kvcached_allocator.alloc(48))
    data_pages, scratch_pages = pages[:16], pages[16:]
    slot_allocator, data_slots, scratch_slots = None, (), ()
    if mamba is not None:
        slots = sorted(mamba.alloc(20).tolist())
        data_slots, scratch_slots = slots[:8], slots[8:]
        slot_allocator = SlotAllocator(scratch_slots, "cuda", rng)
    params = ctl.cache_init_params(pool, PageAllocator(pool, scratch_pages, PAGE, "cuda", rng), slot_allocator)
    full_layers = full_layers or range(pool.layer_num)
    group, controller = ctl.build_stack(params, pool, use_mla=kind == "MLA", full_layers=full_layers,
                                        mamba_pool=mamba, linear_layers=linear_layers)
    try:
        host = group.anchor_entry.host_pool
        assert host.layout == host_layout and controller.io_backend == "kernel"
        kv_families = (mla_families if kind == "MLA" else mha_families)(pool, host)
        fill_random(kv_families, pages_to_rows(pages, PAGE), generator)
        poison(host.kv_buffer, generator)
        state_families = []
        if mamba is not None:
            mamba_host = group.get_entry(PoolName.MAMBA).host_pool
            state_families = mamba_families(mamba, mamba_host)
            fill_random(state_families, torch.tensor([*data_slots, *scratch_slots]), generator)
            for buffer in (mamba_host.temporal_buffer, *mamba_host.conv_buffer):
                poison(buffer, generator)
        trip = ctl.ControllerRoundTrip(controller, group, kv_families, state_families, page_size=PAGE,
                                       data_pages=data_pages, scratch_pages=scratch_pages, data_slots=data_slots,
                                       scratch_slots=scratch_slots, device="cuda")
        start = time.time()
        trip.run(trips)
    finally:
        ctl.release_host_pools(group)
    return controller, time.time() - start


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_mha_qwen25_7b_through_the_controller(host_layout, controller_trips):
    controller, seconds = run("MHA", host_layout, controller_trips)
    record(test="controller: MHA Qwen2.5-7B", host_layout=host_layout, io_backend="kernel",
           trips=controller_trips, result="pass", seconds=round(seconds, 1))


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_mla_deepseek_v2_lite_through_the_controller(host_layout, controller_trips):
    controller, seconds = run("MLA", host_layout, controller_trips)
    record(test="controller: MLA DeepSeek-V2-Lite", host_layout=host_layout, io_backend="kernel",
           trips=controller_trips, result="pass", seconds=round(seconds, 1))


def test_hybrid_mamba_qwen35_4b_through_the_controller(controller_trips):
    m = QWEN35_4B
    mamba = gdn_pool(m)
    controller, seconds = run("hybrid", "page_first", controller_trips, mamba=mamba,
                              full_layers=m.full_attention_layers, linear_layers=m.linear_layers)
    assert controller.layer_num == m.layers
    record(test="controller: hybrid Qwen3.5-4B (MHA + Mamba)", host_layout="page_first", io_backend="kernel",
           trips=controller_trips, result="pass", seconds=round(seconds, 1))
