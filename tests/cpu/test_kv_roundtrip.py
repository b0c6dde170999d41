"""MHA and MLA host pools over kvcached-shaped device pools: byte-exact round trips.

On SGLang 0.5.20 without the series these fail for every kvcached-contiguous case
(MHA: AttributeError, no k_data_ptrs; MLA: host rows differ from the device rows),
which tests/cpu/test_unpatched_fails.py checks by running this file on the pristine tree.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.kvcached_views import LAYOUTS, mha_pool, mla_pool
from tests.support.roundtrip import RoundTrip, fill_random, mha_families, mla_families, pages_to_rows, poison

LAYERS, HEADS, HEAD_DIM = 4, 2, 64
KV_LORA_RANK, ROPE_DIM = 96, 32
DEVICE_PAGES = 12
TRIPS = 12

HOST_CASES = [("layer_first", "kernel"), ("page_first", "kernel"), ("layer_first", "direct"),
              ("page_first_direct", "direct")]
DTYPES = [torch.bfloat16, torch.float8_e4m3fn]


# sglang-kernel's page_first_direct copy takes page_size * stride(0) bytes per layer: it
# serves dense views only, and strided views with it are refused (test_refusals.py).
POOL_CASES = [(layout, host_layout, io_backend) for layout in LAYOUTS for host_layout, io_backend in HOST_CASES
              if not (layout == "kvcached-contiguous" and host_layout == "page_first_direct")]


def every_case(test):
    """Each kvcached layout x host layout and io backend x page size x KV dtype."""
    for mark in (pytest.mark.parametrize("device_layout,host_layout,io_backend", POOL_CASES),
                 pytest.mark.parametrize("page_size", [1, 16, 64]),
                 pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])):
        test = mark(test)
    return test


def run(kind, pool, host, families, page_size, io_backend, **trip_options):
    generator = torch.Generator().manual_seed(3)
    used_pages = list(range(1, DEVICE_PAGES))
    fill_random(families, pages_to_rows(used_pages, page_size), generator)
    poison(host.kv_buffer, generator)
    rt = RoundTrip(
        families, used_pages, range(1, host.size // page_size), page_size, pool.layer_num,
        backup=lambda h, d: host.backup_from_device_all_layer(pool, h, d, io_backend),
        load=lambda h, d, l: host.load_to_device_per_layer(pool, h, d, l, io_backend),
        seed=5, device="cpu", **trip_options,
    )
    rt.run(TRIPS)


@every_case
def test_mha(host_modules, device_layout, host_layout, io_backend, page_size, dtype):
    pool = mha_pool(device_layout, size=DEVICE_PAGES * page_size, page_size=page_size, layers=LAYERS,
                    heads=HEADS, head_dim=HEAD_DIM, dtype=dtype)
    host = host_modules.mha.MHATokenToKVPoolHost(pool, 2.0, 0, page_size, host_layout, pin_memory=False,
                                                 device="cpu")
    run("MHA", pool, host, mha_families(pool, host), page_size, io_backend)


@every_case
def test_mla(host_modules, device_layout, host_layout, io_backend, page_size, dtype):
    pool = mla_pool(device_layout, size=DEVICE_PAGES * page_size, page_size=page_size, layers=LAYERS,
                    kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM, dtype=dtype)
    host = host_modules.mla.MLATokenToKVPoolHost(pool, 2.0, 0, page_size, host_layout, pin_memory=False,
                                                 device="cpu")
    run("MLA", pool, host, mla_families(pool, host), page_size, io_backend)


def test_host_page_runs_are_one_run_or_two_with_a_step_back():
    # what the GPU tier's page_first backups of host page runs draw (RoundTrip(host_runs=True))
    rt = RoundTrip([], [], range(1, 200), 16, 1, backup=None, load=None, host_runs=True, device="cpu")
    shapes = set()
    for n in [2, 7, 64, 100, 199] * 10:
        pages = rt.pick_host_pages(n)
        assert sorted(pages) == list(range(min(pages), min(pages) + n)) and 1 <= min(pages) and max(pages) < 200
        breaks = [i for i in range(1, n) if pages[i] != pages[i - 1] + 1]
        assert len(breaks) <= 1
        shapes.add(len(breaks))
    assert shapes == {0, 1}   # one run, and two runs with a step back, both occur


def test_page_first_backups_of_host_page_runs(host_modules):
    pool = mha_pool("kvcached-contiguous", size=DEVICE_PAGES * 16, page_size=16, layers=LAYERS, heads=HEADS,
                    head_dim=HEAD_DIM, dtype=torch.bfloat16)
    host = host_modules.mha.MHATokenToKVPoolHost(pool, 2.0, 0, 16, "page_first", pin_memory=False, device="cpu")
    run("MHA", pool, host, mha_families(pool, host), 16, "kernel", max_pages=5, host_runs=True)
