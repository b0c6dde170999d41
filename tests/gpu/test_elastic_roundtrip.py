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

from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from tests.gpu.conftest import record
from tests.gpu.pools import PAGE, gdn_pool, mha_pool, mla_pool_of_its_own
from harness.models import DEEPSEEK_V2_LITE, QWEN3_NEXT_80B, QWEN25_7B, QWEN35_4B
from tests.support.roundtrip import (RoundTrip, fill_random, mamba_families, mha_families, mla_families,
                                     pages_to_rows, poison)


def backup_indices(host, rows):
    """Host indices where the cache controller keeps them for a backup."""
    return rows if host.can_use_write_back_jit else rows.cuda()


def run_kv_roundtrip(kind, pool, host_cls, families_of, trips, layout, used=48, check_host=None, check_after=None,
                     **trip_options):
    """Random data in `used` allocated pages, poisoned host bytes, `trips` round trips;
    `check_after()` runs after the trips, before the passing row is recorded."""
    used_pages = pool.kvcached_allocator.alloc(used)
    generator = torch.Generator().manual_seed(0)
    host = host_cls(pool, 2.0, 0, PAGE, layout, pin_memory=True, device="cpu")
    try:
        if check_host:
            check_host(host)
        families = families_of(pool, host)
        fill_random(families, pages_to_rows(used_pages, PAGE), generator)
        poison(host.kv_buffer, generator)
        rt = RoundTrip(
            families, used_pages, range(1, host.size // PAGE), PAGE, len(families[0].device),
            backup=lambda h, d: host.backup_from_device_all_layer(pool, backup_indices(host, h), d, "kernel"),
            load=lambda h, d, l: host.load_to_device_per_layer(pool, h.cuda(), d, l, "kernel"),
            seed=7, **trip_options,
        )
        start = time.time()
        rt.run(trips)
        if check_after:
            check_after()
    finally:
        host.destroy()
    record(test=kind, host_layout=layout, io_backend="kernel", trips=trips, result="pass", **trip_options,
           device_stride_bytes=None if getattr(host, "device_rows_packed", True) else host.device_row_stride_bytes,
           seconds=round(time.time() - start, 1))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mha_qwen25_7b(layout, trips):
    run_kv_roundtrip("MHA Qwen2.5-7B", mha_pool(QWEN25_7B), MHATokenToKVPoolHost, mha_families, trips, layout)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mla_deepseek_v2_lite(layout, trips):
    run_kv_roundtrip("MLA DeepSeek-V2-Lite", mla_pool_of_its_own(DEEPSEEK_V2_LITE), MLATokenToKVPoolHost,
                     mla_families, trips, layout)


# SGLang's host allocator hands out free pages in order, so on a fresh host pool a
# page_first backup's host pages run consecutively. Up to 100 pages per backup: more than
# the staged write-back's 64-page staging chunk, so a backup takes two launches.
RUN_PAGES = 100


def test_mha_page_first_backups_of_host_page_runs(trips):
    run_kv_roundtrip("MHA Qwen2.5-7B, host page runs", mha_pool(QWEN25_7B, pages=4 * RUN_PAGES),
                     MHATokenToKVPoolHost, mha_families, min(trips, 40), "page_first",
                     used=2 * RUN_PAGES, max_pages=RUN_PAGES, host_runs=True)


def test_mha_page_first_backups_of_small_host_page_runs(trips):
    # One layer: 64 KiB pages, under the staged write-back's 128 KiB batch threshold, so
    # its copies go one cudaMemcpyAsync each (the batched path serves larger pages).
    run_kv_roundtrip("MHA Qwen2.5-7B one layer, host page runs", mha_pool(QWEN25_7B, layers=1, pages=4 * RUN_PAGES),
                     MHATokenToKVPoolHost, mha_families, min(trips, 40), "page_first", used=2 * RUN_PAGES,
                     max_pages=RUN_PAGES, host_runs=True)


def test_mla_page_first_backups_of_host_page_runs(trips):
    pool = mla_pool_of_its_own(DEEPSEEK_V2_LITE, pages=4 * RUN_PAGES)
    run_kv_roundtrip("MLA DeepSeek-V2-Lite, host page runs", pool, MLATokenToKVPoolHost, mla_families,
                     min(trips, 40), "page_first", used=2 * RUN_PAGES, max_pages=RUN_PAGES, host_runs=True)


@pytest.mark.parametrize("model", [QWEN35_4B, QWEN3_NEXT_80B], ids=lambda m: m.name)
def test_mamba_gdn(model, trips):
    layers = model.linear_layers
    pool = gdn_pool(model)
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
           device_stride_bytes=host.device_temporal_layers[0].stride(0) * host.device_temporal_layers[0].element_size(),
           seconds=round(time.time() - start, 1))
