"""--hicache-size is shared by the KV each device pool serves, elastic or not.

The device pools are SGLang's own classes (built as its unit tests build them, without
__init__), model-shaped (Qwen3.5-4B, gpt-oss-20b) and on the meta device: the split
reads shapes and byte counts, never data, so kvcached's VA-sized buffers (a GPU's
memory each) cost nothing here. On SGLang 0.5.20 without the series the elastic shares
differ from native's (the Mamba host pool starves).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from harness.models import DEEPSEEK_V2_LITE, GPT_OSS_20B, QWEN35_4B

GPU_BYTES = 80 * 10**9  # an 80 GB card
KVCACHED_PAGE = 2 << 20
PAGE = 64


def kv_pool(layout, *, size, layers, heads, head_dim, dtype=torch.bfloat16):
    """An MHA device pool's buffers as SGLang (native) or kvcached would shape them."""
    row = heads * head_dim * dtype.itemsize
    rows = size + PAGE
    if layout != "native":  # kvcached: every layer's buffer spans its share of the VA reservation
        per_layer = GPU_BYTES // layers // 2 // KVCACHED_PAGE * KVCACHED_PAGE
        rows = per_layer // (PAGE * row) * PAGE
    if layout == "kvcached-contiguous":
        whole = torch.empty((rows, layers, 2, heads, head_dim), dtype=dtype, device="meta")
        k = [whole[:, l, 0] for l in range(layers)]
        v = [whole[:, l, 1] for l in range(layers)]
    else:
        k = [torch.empty((rows, heads, head_dim), dtype=dtype, device="meta") for _ in range(layers)]
        v = [torch.empty((rows, heads, head_dim), dtype=dtype, device="meta") for _ in range(layers)]
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool.__new__(MHATokenToKVPool)
    pool.k_buffer, pool.v_buffer, pool.size, pool.page_size = k, v, size, PAGE
    return pool


def mla_pool(layout, *, size, layers, kv_dim, dtype=torch.bfloat16):
    """An MLA device pool (one kv_buffer view per layer) as SGLang or kvcached would shape it."""
    rows = size + PAGE
    if layout != "native":
        per_layer = GPU_BYTES // layers // KVCACHED_PAGE * KVCACHED_PAGE
        rows = per_layer // (PAGE * kv_dim * dtype.itemsize) * PAGE
    if layout == "kvcached-contiguous":
        whole = torch.empty((rows, layers, 1, kv_dim), dtype=dtype, device="meta")
        kv = [whole[:, l] for l in range(layers)]
    else:
        kv = [torch.empty((rows, 1, kv_dim), dtype=dtype, device="meta") for _ in range(layers)]
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool.__new__(MLATokenToKVPool)
    pool.kv_buffer, pool.size, pool.page_size = kv, size, PAGE
    return pool


def mamba_pool(model, slots):
    """MambaPool.get_kv_size_bytes counts its (slots + 1) states per layer, elastic or not."""
    from sglang.srt.mem_cache.memory_pool import MambaPool

    conv = math.prod(model.conv_state_shape) * 2
    ssm = math.prod(model.temporal_state_shape) * 4
    pool = MambaPool.__new__(MambaPool)
    pool.size = slots
    pool.mamba_cache = SimpleNamespace(mem_usage_bytes=lambda: len(model.linear_layers) * (slots + 1) * (conv + ssm))
    return pool


@pytest.fixture
def split():
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _split_hicache_size

    return _split_hicache_size


def qwen35_pools(layout):
    m = QWEN35_4B
    kv = kv_pool(layout, size=200_000, layers=len(m.full_attention_layers), heads=m.kv_heads, head_dim=m.head_dim)
    return kv, mamba_pool(m, slots=64)


@pytest.mark.parametrize("layout", ["kvcached-contiguous", "kvcached-per-layer"])
def test_qwen35_mamba_split_equals_native(split, layout):
    native = split(14, qwen35_pools("native"))
    elastic = split(14, qwen35_pools(layout))
    assert elastic == pytest.approx(native, rel=1e-12)
    m = QWEN35_4B
    slot_bytes = len(m.linear_layers) * (math.prod(m.conv_state_shape) * 2 + math.prod(m.temporal_state_shape) * 4)
    assert int(elastic[1] * 1e9 // slot_bytes) == int(native[1] * 1e9 // slot_bytes)
    assert sum(elastic) == pytest.approx(14, abs=1e-12)


def test_qwen35_mamba_host_pool_gets_the_slots_native_gives(split):
    """Slots of the Mamba host pool (MambaPoolHost: host_size * 1e9 // size_per_token)."""
    m = QWEN35_4B
    slot_bytes = len(m.linear_layers) * (math.prod(m.conv_state_shape) * 2 + math.prod(m.temporal_state_shape) * 4)
    slots = {layout: int(split(14, qwen35_pools(layout))[1] * 1e9 // slot_bytes)
             for layout in ("native", "kvcached-contiguous", "kvcached-per-layer")}
    assert slots["kvcached-contiguous"] == slots["kvcached-per-layer"] == slots["native"] > 0


@pytest.mark.parametrize("layout", ["kvcached-contiguous", "kvcached-per-layer"])
def test_swa_split_equals_native(split, layout):
    m = GPT_OSS_20B
    half = m.layers // 2

    def pools(kind):
        full = kv_pool(kind, size=300_000, layers=half, heads=m.kv_heads, head_dim=m.head_dim)
        window = kv_pool(kind, size=40_000, layers=half, heads=m.kv_heads, head_dim=m.head_dim)
        return full, window

    native, elastic = split(20, pools("native")), split(20, pools(layout))
    assert elastic == pytest.approx(native, rel=1e-12)
    assert native[0] / native[1] == pytest.approx((300_000 + PAGE) / (40_000 + PAGE))


@pytest.mark.parametrize("layout", ["kvcached-contiguous", "kvcached-per-layer"])
def test_mla_beside_mamba_split_equals_native(split, layout):
    """Hybrid linear-attention models whose full-attention layers are MLA (Kimi-Linear's
    kind) put an MLA pool (kv_buffer, no k_buffer) beside the Mamba pool."""
    m = DEEPSEEK_V2_LITE
    pools = lambda kind: (mla_pool(kind, size=200_000, layers=8, kv_dim=m.kv_dim), mamba_pool(QWEN35_4B, slots=64))
    assert split(14, pools(layout)) == pytest.approx(split(14, pools("native")), rel=1e-12)


@pytest.mark.parametrize("layout", ["kvcached-contiguous", "kvcached-per-layer"])
def test_one_attention_layer_split_equals_native(split, layout):
    """A pool of a single layer (a pipeline stage with one full-attention layer) is
    counted by the rows it serves like any other."""
    m = QWEN35_4B
    pools = lambda kind: (kv_pool(kind, size=200_000, layers=1, heads=m.kv_heads, head_dim=m.head_dim),
                          mamba_pool(m, slots=64))
    assert split(14, pools(layout)) == pytest.approx(split(14, pools("native")), rel=1e-12)


def test_three_pools_share_by_their_bytes(split):
    """Full attention, sliding window and Mamba (the hybrid SWA + Mamba builder): every
    pool gets its share of the KV it serves."""
    m = QWEN35_4B
    full = kv_pool("kvcached-contiguous", size=300_000, layers=4, heads=m.kv_heads, head_dim=m.head_dim)
    window = kv_pool("kvcached-contiguous", size=40_000, layers=4, heads=m.kv_heads, head_dim=m.head_dim)
    mamba = mamba_pool(m, slots=64)
    row = m.kv_heads * m.head_dim * 2 * 2 * 4  # K and V, bf16, 4 layers
    weights = [(300_000 + PAGE) * row, (40_000 + PAGE) * row, mamba.get_kv_size_bytes()]
    shares = split(30, (full, window, mamba))
    assert shares == pytest.approx([30 * w / sum(weights) for w in weights], rel=1e-12)
