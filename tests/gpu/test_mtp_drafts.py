"""MTP draft layers packed into the target's host pool, over real kvcached pools.

As SGLang packs NextN drafts for EAGLE: a one-layer draft pool per draft, its layers
appended to the target's in one host pool. kvcached allocates every pool on its own,
so the draft's views have their own stride; each pool's layers are copied with it.
On SGLang 0.5.20 without the series the packed host pool cannot be built over
strided views (no k_data_ptrs). MLA drafts are covered by the CPU tier
(tests/cpu/test_mtp_drafts.py): on the GPU, writing the test's data into kvcached 0.1.6's
one-layer MLA pool failed with an illegal address before any HiCache code ran.
"""
from __future__ import annotations

import time

import pytest
import torch

from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from tests.gpu.conftest import record
from tests.gpu.pools import PAGE, mha_pool
from tests.support.models import QWEN25_7B
from tests.support.roundtrip import RoundTrip, Rows, fill_random, host_layer_rows, pages_to_rows, poison


def run_packed(kind, target, draft, host_cls, families_of, trips, layout):
    # SGLang gives a token the same index in the target and draft pools; kvcached maps
    # pages per pool, so use the pages both pools have mapped.
    used_pages = sorted(set(target.kvcached_allocator.alloc(48)) & set(draft.kvcached_allocator.alloc(48)))
    assert len(used_pages) >= 16, used_pages
    host = host_cls(target, 2.0, 0, PAGE, layout, pin_memory=True, device="cpu", mtp_draft_device_pools=[draft])
    layers = target.layer_num + 1
    try:
        assert [run.layer_num for run in host.strided_device_layers or []] in ([], [target.layer_num, 1])
        families = families_of(target, draft, host)
        generator = torch.Generator().manual_seed(0)
        fill_random(families, pages_to_rows(used_pages, PAGE), generator)
        poison(host.kv_buffer, generator)

        def load(h, d, layer):
            if layer < target.layer_num:
                host.load_to_device_per_layer(target, h.cuda(), d, layer, "kernel")
            else:
                host.load_to_device_per_layer(draft, h.cuda(), d, layer, "kernel", is_draft=True)

        rt = RoundTrip(
            families, used_pages, range(1, host.size // PAGE), PAGE, layers,
            backup=lambda h, d: host.backup_from_device_all_layer(
                target, h if host.can_use_write_back_jit else h.cuda(), d, "kernel"),
            load=load, seed=9,
        )
        start = time.time()
        rt.run(trips)
    finally:
        host.destroy()
    record(test=kind, host_layout=layout, io_backend="kernel", trips=trips, result="pass",
           runs=[(r.layer_num, r.stride_bytes) for r in host.strided_device_layers or []],
           seconds=round(time.time() - start, 1))


def mha_families(target, draft, host):
    pools = (target, draft)
    return [Rows("K", [v for p in pools for v in p.k_buffer], host_layer_rows(host, host.k_data_refs, 0)),
            Rows("V", [v for p in pools for v in p.v_buffer], host_layer_rows(host, host.v_data_refs, 1))]


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mha_qwen25_7b_with_a_draft(layout, trips):
    run_packed("MHA Qwen2.5-7B + 1 MTP draft", mha_pool(QWEN25_7B), mha_pool(QWEN25_7B, layers=1),
               MHATokenToKVPoolHost, mha_families, trips, layout)
