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
from tests.support.models import DEEPSEEK_V2_LITE, QWEN3_NEXT_80B, QWEN25_7B, QWEN35_4B
from tests.support.roundtrip import (RoundTrip, as_bytes, fill_random, mamba_families, mha_families, mla_families,
                                     pages_to_rows, poison, random_rows)


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
           device_stride_bytes=host.strided_device_layers[0].stride_bytes if host.strided_device_layers else None,
           seconds=round(time.time() - start, 1))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mha_qwen25_7b(layout, trips):
    run_kv_roundtrip("MHA Qwen2.5-7B", mha_pool(QWEN25_7B), MHATokenToKVPoolHost, mha_families, trips, layout)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mla_deepseek_v2_lite(layout, trips):
    run_kv_roundtrip("MLA DeepSeek-V2-Lite", mla_pool_of_its_own(DEEPSEEK_V2_LITE), MLATokenToKVPoolHost,
                     mla_families, trips, layout)


# SGLang's host allocator hands out free pages in order, so on a fresh host pool a
# page_first backup's host pages run consecutively, as they do in the staged write-back's
# staging buffer. Up to 100 pages per backup: runs longer than its 64-page staging chunk,
# one or two per backup; a backup of more than 64 pages runs in the buffer's two halves,
# on two streams at once.
RUN_PAGES = 100


@pytest.fixture
def backups_in_staging_halves(monkeypatch):
    """Records which staging half each write-back launch used; returns a check that
    some backups alternated both halves (so their gathers and copies overlapped)."""
    from sglang.kernels.ops.kvcache import hicache

    halves, plan_launches = [], hicache._staged_write_back_launches

    def recorded(*args):
        launches = plan_launches(*args)
        halves.extend(half for _, _, half in launches)
        return launches

    monkeypatch.setattr(hicache, "_staged_write_back_launches", recorded)

    def check():
        assert {0, 1} <= set(halves), f"no backup ran in staging halves: {sorted(set(halves), key=str)}"
    return check


def test_mha_page_first_backups_of_host_page_runs(trips, backups_in_staging_halves):
    run_kv_roundtrip("MHA Qwen2.5-7B, host page runs", mha_pool(QWEN25_7B, pages=4 * RUN_PAGES),
                     MHATokenToKVPoolHost, mha_families, min(trips, 40), "page_first",
                     used=2 * RUN_PAGES, max_pages=RUN_PAGES, host_runs=True, check_after=backups_in_staging_halves)


def test_mha_page_first_backup_is_ordered_with_the_stream_that_issues_it(backups_in_staging_halves):
    # A backup of more than 64 pages runs its launches on two side streams. Issued on a
    # stream still busy with a spin kernel and then with new writes to the rows it backs
    # up, it must copy the new rows (its side streams wait for that stream), and a host
    # read after an event recorded on that stream, with no device-wide synchronize, must
    # see every copy (that stream waits for the side streams). The round trips above
    # synchronize after every backup and so check neither.
    from sglang.kernels.ops.kvcache import hicache

    pool = mha_pool(QWEN25_7B, pages=4 * RUN_PAGES)
    used = pool.kvcached_allocator.alloc(RUN_PAGES)
    host = MHATokenToKVPoolHost(pool, 2.0, 0, PAGE, "page_first", pin_memory=True, device="cpu")
    try:
        families, rows = mha_families(pool, host), pages_to_rows(used, PAGE)
        generator = torch.Generator().manual_seed(5)
        fill_random(families, rows, generator)
        new = [[random_rows(view, rows.numel(), generator).cuda() for view in family.device] for family in families]
        device_rows, host_rows = rows.cuda(), pages_to_rows(range(1, RUN_PAGES + 1), PAGE)
        # A first backup elsewhere in the host pool builds the kernels and the side
        # streams, so that nothing in the timed one waits for the host.
        warm_up = pages_to_rows(range(RUN_PAGES + 1, 2 * RUN_PAGES + 1), PAGE)
        host.backup_from_device_all_layer(pool, backup_indices(host, warm_up), device_rows, "kernel")
        torch.cuda.synchronize()
        device = torch.device("cuda", torch.cuda.current_device())
        sides = {s.cuda_stream for s in hicache._write_back_streams(device, 0)}
        # torch hands out pooled streams in turn: take one that is not a side stream
        stream = next(s for s in (torch.cuda.Stream(device) for _ in range(64)) if s.cuda_stream not in sides)
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1_000_000_000)  # about half a second: the backup is issued long before it may start
            for family, values in zip(families, new):
                for view, value in zip(family.device, values):
                    view[device_rows] = value
            host.backup_from_device_all_layer(pool, backup_indices(host, host_rows), device_rows, "kernel")
            assert not stream.query(), "the backup was issued after its stream went idle: nothing was checked"
            done.record()
        done.synchronize()
        for family, values in zip(families, new):
            for layer, value in enumerate(values):
                assert torch.equal(as_bytes(family.host(layer)[host_rows]), as_bytes(value).cpu()), (
                    f"{family.name} layer {layer}: host rows are not the rows written before the backup")
        backups_in_staging_halves()
    finally:
        host.destroy()
    record(test="MHA Qwen2.5-7B, backup ordered with its stream", host_layout="page_first", io_backend="kernel",
           trips=1, result="pass", pages=RUN_PAGES)


def test_mha_page_first_backups_of_host_page_runs_across_host_registrations(monkeypatch):
    # SGLang pins a host pool in pieces of SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB (1 GiB at
    # least, cut at page boundaries), and one copy must not span two: here about 2.9 GB of
    # host pool (801 pages of 1.8 MB for K, as many for V) in pieces of 585 pages, so K's
    # first boundary is at host page 585 and V's at page 369. Besides the bytes, every
    # write-back launch is checked: no run of consecutive host pages in it crosses a piece,
    # and some backups had a run that did, cut at the boundary.
    from sglang.kernels.ops.kvcache import hicache

    monkeypatch.setenv("SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB", "1")
    launches, cut_at_a_boundary = [], []
    plan_launches = hicache._staged_write_back_calls

    def piece_of(address, pieces):
        return next(i for i, (start, size) in enumerate(pieces) if start <= address < start + size)

    def recorded(dst_indices, dsts, pieces, num_pages, page_size, capacity):
        calls = plan_launches(dst_indices, dsts, pieces, num_pages, page_size, capacity)
        first = dst_indices[::page_size].tolist()
        for dst in dsts:
            page_address = [dst.data_ptr() + h * dst.stride(0) * dst.element_size() for h in first]
            for begin, count in calls:
                for i in range(begin + 1, begin + count):
                    if first[i] == first[i - 1] + page_size:
                        assert piece_of(page_address[i], pieces) == piece_of(page_address[i - 1], pieces)
                if begin and first[begin] == first[begin - 1] + page_size:
                    cut_at_a_boundary.append(
                        piece_of(page_address[begin], pieces) != piece_of(page_address[begin - 1], pieces))
        launches.extend(calls)
        return calls

    monkeypatch.setattr(hicache, "_staged_write_back_calls", recorded)

    def in_pieces(host):
        pieces = getattr(host.kv_buffer, "_sglang_cuda_host_registered_ranges", ())
        assert len(pieces) >= 2, f"host pool pinned in {len(pieces)} piece(s)"

    def some_run_was_cut():
        assert launches and any(cut_at_a_boundary), "no backup had a run across a registration boundary"

    # 100 trips whatever GPU_TRIPS says: the trips are seeded, and with fewer (20) no
    # backup's run reached a boundary.
    run_kv_roundtrip("MHA Qwen2.5-7B, host page runs, 1 GiB registrations",
                     mha_pool(QWEN25_7B, pages=4 * RUN_PAGES), MHATokenToKVPoolHost, mha_families,
                     100, "page_first", used=2 * RUN_PAGES, check_host=in_pieces, check_after=some_run_was_cut,
                     max_pages=RUN_PAGES, host_runs=True)


def test_mha_page_first_backups_of_small_host_page_runs(trips):
    # One layer: 64 KiB pages, under the staged write-back's 128 KiB batch threshold, so
    # its copies go one cudaMemcpyAsync each (the batched path serves larger pages).
    run_kv_roundtrip("MHA Qwen2.5-7B one layer, host page runs", mha_pool(QWEN25_7B, layers=1, pages=4 * RUN_PAGES),
                     MHATokenToKVPoolHost, mha_families, min(trips, 40), "page_first", used=2 * RUN_PAGES,
                     max_pages=RUN_PAGES, host_runs=True)


def test_mla_page_first_backups_of_host_page_runs(trips, backups_in_staging_halves):
    pool = mla_pool_of_its_own(DEEPSEEK_V2_LITE, pages=4 * RUN_PAGES)
    run_kv_roundtrip("MLA DeepSeek-V2-Lite, host page runs", pool, MLATokenToKVPoolHost, mla_families,
                     min(trips, 40), "page_first", used=2 * RUN_PAGES, max_pages=RUN_PAGES, host_runs=True,
                     check_after=backups_in_staging_halves)


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
           device_stride_bytes=host.temporal_device_stride_bytes, seconds=round(time.time() - start, 1))
