"""Backup + load round trips through SGLang's host pools over real kvcached elastic pools.

Run by `make test-gpu` once per kvcached layout. On SGLang 0.5.20 without the series:
MHA backups raise AttributeError (no k_data_ptrs), MLA and contiguous-layout Mamba
round trips fail the content checks, per-layer-layout Mamba raises "item_size must be
16-byte aligned".
"""
from __future__ import annotations

import time

import pytest
import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.mem_cache import memory_pool as mp
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from tests.gpu.conftest import kvcached_builds_no_per_layer_mla, record
from tests.support.models import DEEPSEEK_V2_LITE, QWEN3_NEXT_80B, QWEN25_7B, QWEN35_4B
from tests.support.roundtrip import RoundTrip, fill_random, mamba_families, mha_families, mla_families, pages_to_rows, poison

PAGE = 64
DEVICE_PAGES = 64  # device pool of 4096 tokens; trips use 48 allocated pages


def backup_indices(host, rows):
    """Host indices where the cache controller keeps them for a backup."""
    return rows if host.can_use_write_back_jit else rows.cuda()


def elastic(pool):
    assert type(pool).__name__.startswith("Elastic"), f"not a kvcached pool: {type(pool).__name__}"
    pool.kvcached_allocator._wait_post_init()  # kvcached 0.1.6: alloc before post-init deadlocks
    return pool


def run_kv_roundtrip(kind, pool, host, families, used_pages, trips, layout):
    host_pages = range(1, host.size // PAGE)
    rt = RoundTrip(
        families, used_pages, host_pages, PAGE, len(families[0].device),
        backup=lambda h, d: host.backup_from_device_all_layer(pool, backup_indices(host, h), d, "kernel"),
        load=lambda h, d, l: host.load_to_device_per_layer(pool, h.cuda(), d, l, "kernel"),
        seed=7,
    )
    start = time.time()
    rt.run(trips)
    record(test=kind, host_layout=layout, io_backend="kernel", trips=trips, result="pass",
           device_stride_bytes=getattr(host, "device_token_stride_bytes", None), seconds=round(time.time() - start, 1))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mha_qwen25_7b(layout, trips):
    s = QWEN25_7B
    pool = elastic(mp.MHATokenToKVPool(size=DEVICE_PAGES * PAGE, page_size=PAGE, dtype=torch.bfloat16,
                                       head_num=s.kv_heads, head_dim=s.head_dim, layer_num=s.layers,
                                       device="cuda", enable_memory_saver=False))
    used_pages = pool.kvcached_allocator.alloc(48)
    generator = torch.Generator().manual_seed(0)
    host = MHATokenToKVPoolHost(pool, 2.0, 0, PAGE, layout, pin_memory=True, device="cpu")
    families = mha_families(pool, host)
    fill_random(families, pages_to_rows(used_pages, PAGE), generator)
    poison(host.kv_buffer, generator)
    try:
        run_kv_roundtrip("MHA Qwen2.5-7B", pool, host, families, used_pages, trips, layout)
    finally:
        host.destroy()


@kvcached_builds_no_per_layer_mla
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mla_deepseek_v2_lite(layout, trips):
    s = DEEPSEEK_V2_LITE
    pool = elastic(mp.MLATokenToKVPool(size=DEVICE_PAGES * PAGE, page_size=PAGE, dtype=torch.bfloat16,
                                       kv_lora_rank=s.kv_lora_rank, qk_rope_head_dim=s.qk_rope_head_dim,
                                       layer_num=s.layers, device="cuda", enable_memory_saver=False))
    used_pages = pool.kvcached_allocator.alloc(48)
    generator = torch.Generator().manual_seed(0)
    host = MLATokenToKVPoolHost(pool, 2.0, 0, PAGE, layout, pin_memory=True, device="cpu")
    families = mla_families(pool, host)
    fill_random(families, pages_to_rows(used_pages, PAGE), generator)
    poison(host.kv_buffer, generator)
    try:
        run_kv_roundtrip("MLA DeepSeek-V2-Lite", pool, host, families, used_pages, trips, layout)
    finally:
        host.destroy()


@pytest.mark.parametrize("model", [QWEN35_4B, QWEN3_NEXT_80B], ids=lambda m: m.name)
def test_mamba_gdn(model, trips):
    shape = Mamba2StateShape.create(**model.state_shape_kwargs())
    assert tuple(shape.conv[0]) == model.conv_state_shape and tuple(shape.temporal) == model.temporal_state_shape
    layers = model.linear_layers
    params = Mamba2CacheParams(shape=shape, layers=layers,
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
    slots = 24
    pool = mp.MambaPool(size=slots, spec_state_size=slots, cache_params=params,
                        mamba_layer_ids=list(range(len(layers))), device="cuda")
    assert type(pool).__name__.startswith("Elastic")
    pool.kvcached_allocator._wait_post_init()
    used = sorted(pool.alloc(20).tolist())
    host = MambaPoolHost(pool, 2.0, 0, pin_memory=True, device="cpu", layout="page_first")
    # The host pool must see the model's real shapes (native SGLang's sizing).
    assert tuple(host.temporal_state_shape) == model.temporal_state_shape
    assert [tuple(c) for c in host.conv_state_shapes] == [model.conv_state_shape]
    generator = torch.Generator().manual_seed(0)
    families = mamba_families(pool, host)
    fill_random(families, torch.tensor(used), generator)
    for buffer in (host.temporal_buffer, *host.conv_buffer):
        poison(buffer, generator)
    rt = RoundTrip(
        families, used, range(host.size), 1, len(layers),
        backup=lambda h, d: host.backup_from_device_all_layer(pool, h, d, "kernel"),
        load=lambda h, d, l: host.load_to_device_per_layer(pool, h.cuda(), d, l, "kernel"),
        seed=11, max_pages=2,
    )
    start = time.time()
    try:
        rt.run(trips)
    finally:
        host.destroy() if hasattr(host, "destroy") else None
    record(test=f"Mamba {model.name}", host_layout="page_first", io_backend="kernel", trips=trips, result="pass",
           device_stride_bytes=getattr(host, "temporal_device_slot_stride", None), seconds=round(time.time() - start, 1))
