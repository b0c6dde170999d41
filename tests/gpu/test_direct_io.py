"""`--hicache-io-backend direct` over real kvcached pools: host pools' direct paths.

The direct copies live in sglang-kernel's AOT module (transfer_kv_direct and friends:
Tensor.copy_ over runs of indices). Runners with sglang-kernel installed run these
tests; the stand-in sgl_kernel of a machine without it (which raises when called) makes
them skip with that reason. The CPU tier runs the same paths with exact emulators.
Indices are where SGLang's cache controller puts them for direct io (move_indices).
"""
from __future__ import annotations

import pytest
import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.mem_cache import memory_pool as mp
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from tests.gpu.conftest import kvcached_builds_no_per_layer_mla, record
from tests.support.models import DEEPSEEK_V2_LITE, QWEN25_7B, QWEN35_4B
from tests.support.roundtrip import RoundTrip, fill_random, mamba_families, mha_families, mla_families, pages_to_rows, poison

sgl_kernel = pytest.importorskip("sgl_kernel", reason="needs sglang-kernel (SGLang's AOT kernels)")
pytestmark = pytest.mark.skipif(getattr(sgl_kernel, "IS_SGL_KERNEL_STUB", False),
                                reason="needs sglang-kernel's AOT direct-io kernels (a stand-in is installed)")
PAGE = 64


def direct_indices(layout, host_rows, device_rows):
    """HiCacheController.move_indices for io backend `direct`."""
    device_rows = device_rows.cpu()
    if layout == "layer_first":
        host_rows, order = host_rows.sort()
        return host_rows, device_rows.index_select(0, order)
    return host_rows, device_rows


def kv_trips(kind, pool, host, families, layout, trips):
    used_pages = pool.kvcached_allocator.alloc(48)
    fill_random(families, pages_to_rows(used_pages, PAGE), torch.Generator().manual_seed(0))
    poison(host.kv_buffer, torch.Generator().manual_seed(1))
    rt = RoundTrip(
        families, used_pages, range(1, host.size // PAGE), PAGE, len(families[0].device),
        backup=lambda h, d: host.backup_from_device_all_layer(pool, *direct_indices(layout, h, d), "direct"),
        load=lambda h, d, l: host.load_to_device_per_layer(pool, *direct_indices(layout, h, d), l, "direct"),
        seed=9,
    )
    try:
        rt.run(trips)
    finally:
        host.destroy()
    record(test=f"direct io: {kind}", host_layout=layout, io_backend="direct", trips=trips, result="pass")


def elastic(pool):
    assert type(pool).__name__.startswith("Elastic")
    pool.kvcached_allocator._wait_post_init()
    return pool


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_mha_direct(layout, trips):
    s = QWEN25_7B
    pool = elastic(mp.MHATokenToKVPool(size=64 * PAGE, page_size=PAGE, dtype=torch.bfloat16, head_num=s.kv_heads,
                                       head_dim=s.head_dim, layer_num=s.layers, device="cuda",
                                       enable_memory_saver=False))
    host = MHATokenToKVPoolHost(pool, 2.0, 0, PAGE, layout, pin_memory=True, device="cpu")
    kv_trips("MHA Qwen2.5-7B", pool, host, mha_families(pool, host), layout, trips)


@kvcached_builds_no_per_layer_mla
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_mla_direct(layout, trips):
    s = DEEPSEEK_V2_LITE
    pool = elastic(mp.MLATokenToKVPool(size=64 * PAGE, page_size=PAGE, dtype=torch.bfloat16,
                                       kv_lora_rank=s.kv_lora_rank, qk_rope_head_dim=s.qk_rope_head_dim,
                                       layer_num=s.layers, device="cuda", enable_memory_saver=False))
    host = MLATokenToKVPoolHost(pool, 2.0, 0, PAGE, layout, pin_memory=True, device="cpu")
    kv_trips("MLA DeepSeek-V2-Lite", pool, host, mla_families(pool, host), layout, trips)


def test_mamba_direct_qwen35(trips):
    m = QWEN35_4B
    params = Mamba2CacheParams(shape=Mamba2StateShape.create(**m.state_shape_kwargs()), layers=m.linear_layers,
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
    pool = mp.MambaPool(size=24, spec_state_size=24, cache_params=params,
                        mamba_layer_ids=list(range(len(m.linear_layers))), device="cuda")
    elastic(pool)
    used = sorted(pool.alloc(20).tolist())
    host = MambaPoolHost(pool, 2.0, 0, pin_memory=True, device="cpu", layout="page_first_direct")
    families = mamba_families(pool, host)
    fill_random(families, torch.tensor(used), torch.Generator().manual_seed(0))
    for buffer in (host.temporal_buffer, *host.conv_buffer):
        poison(buffer, torch.Generator().manual_seed(1))
    rt = RoundTrip(families, used, range(host.size), 1, len(m.linear_layers),
                   backup=lambda h, d: host.backup_from_device_all_layer(pool, h, d.cpu(), "direct"),
                   load=lambda h, d, l: host.load_to_device_per_layer(pool, h, d.cpu(), l, "direct"),
                   seed=13, max_pages=2)
    rt.run(trips)
    record(test="direct io: Mamba Qwen3.5-4B", host_layout="page_first_direct", io_backend="direct", trips=trips,
           result="pass")
