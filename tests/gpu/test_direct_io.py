"""`--hicache-io-backend direct` over real kvcached pools: host pools' direct paths.

The direct copies live in sglang-kernel's AOT module (transfer_kv_direct and friends:
Tensor.copy_ over runs of indices). Runners with sglang-kernel installed run these
tests; the stand-in sgl_kernel of a machine without it (which raises when called) makes
them skip with that reason. The CPU tier runs the same paths with exact emulators.
Indices are where SGLang's cache controller puts them for direct io (its move_indices).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from tests.gpu.conftest import record
from tests.gpu.pools import PAGE, gdn_pool, mha_pool, mla_pool_of_its_own
from harness.models import DEEPSEEK_V2_LITE, QWEN25_7B, QWEN35_4B
from tests.support.roundtrip import RoundTrip, fill_random, mha_families, mla_families, pages_to_rows, poison

sgl_kernel = pytest.importorskip("sgl_kernel", reason="needs sglang-kernel (SGLang's AOT kernels)")
pytestmark = pytest.mark.skipif(getattr(sgl_kernel, "IS_SGL_KERNEL_STUB", False),
                                reason="needs sglang-kernel's AOT direct-io kernels (a stand-in is installed)")


def direct_indices(host, host_rows, device_rows):
    """Where SGLang's cache controller puts the indices for io backend `direct`."""
    return HiCacheController.move_indices(SimpleNamespace(io_backend="direct", mem_pool_host=host),
                                          host_rows, device_rows)


def kv_trips(kind, pool, host, families, layout, trips):
    used_pages = pool.kvcached_allocator.alloc(48)
    fill_random(families, pages_to_rows(used_pages, PAGE), torch.Generator().manual_seed(0))
    poison(host.kv_buffer, torch.Generator().manual_seed(1))
    rt = RoundTrip(
        families, used_pages, range(1, host.size // PAGE), PAGE, len(families[0].device),
        backup=lambda h, d: host.backup_from_device_all_layer(pool, *direct_indices(host, h, d), "direct"),
        load=lambda h, d, l: host.load_to_device_per_layer(pool, *direct_indices(host, h, d), l, "direct"),
        seed=9,
    )
    # On a stream of its own, as SGLang's transfer engine runs every backup and load:
    # sglang-kernel's batched direct copies (cudaMemcpyBatchAsync) refuse the legacy
    # default stream ("invalid argument"), and the error they leave pending fails the
    # next launch, in the next test.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            rt.run(trips)
    finally:
        try:
            torch.cuda.synchronize()
        finally:
            host.destroy()
    record(test=f"direct io: {kind}", host_layout=layout, io_backend="direct", trips=trips, result="pass")


def page_first_direct_is_served(pool_views):
    """sglang-kernel's page_first_direct copies take page_size * stride(0) bytes per layer:
    the host pools refuse it for strided views (kvcached's contiguous layout)."""
    return all(view.is_contiguous() for view in pool_views)


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_mha_direct(layout, trips):
    pool = mha_pool(QWEN25_7B)
    if layout == "page_first_direct" and not page_first_direct_is_served([*pool.k_buffer, *pool.v_buffer]):
        with pytest.raises(ValueError, match="page_first_direct"):
            MHATokenToKVPoolHost(pool, 2.0, 0, PAGE, layout, pin_memory=True, device="cpu")
        return
    host = MHATokenToKVPoolHost(pool, 2.0, 0, PAGE, layout, pin_memory=True, device="cpu")
    kv_trips("MHA Qwen2.5-7B", pool, host, mha_families(pool, host), layout, trips)


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_mla_direct(layout, trips):
    pool = mla_pool_of_its_own(DEEPSEEK_V2_LITE)
    if layout == "page_first_direct" and not page_first_direct_is_served(pool.kv_buffer):
        with pytest.raises(ValueError, match="page_first_direct"):
            MLATokenToKVPoolHost(pool, 2.0, 0, PAGE, layout, pin_memory=True, device="cpu")
        return
    host = MLATokenToKVPoolHost(pool, 2.0, 0, PAGE, layout, pin_memory=True, device="cpu")
    kv_trips("MLA DeepSeek-V2-Lite", pool, host, mla_families(pool, host), layout, trips)


def test_mamba_direct_is_refused_qwen35():
    """kvcached's Mamba state views are strided in both of its layouts, and sglang-kernel's
    page_first_direct copies take stride(0) bytes per slot: refused at construction."""
    pool = gdn_pool(QWEN35_4B)
    with pytest.raises(ValueError, match="page_first_direct"):
        MambaPoolHost(pool, 2.0, 0, pin_memory=True, device="cpu", layout="page_first_direct")
