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
ELASTIC = ("kvcached-contiguous", "kvcached-per-layer")


def kv_pool(layout, *, size, layers, heads=1, head_dim=None, kv_dim=None):
    """An MHA device pool (K and V views per layer), or with ``kv_dim`` an MLA one (one view per
    layer), in bf16, its buffers shaped as SGLang (native) or kvcached would shape them."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    cls, parts, row = (MLATokenToKVPool, 1, (1, kv_dim)) if kv_dim else (MHATokenToKVPool, 2, (heads, head_dim))
    rows = size + PAGE
    if layout != "native":  # kvcached: every layer's buffer spans its share of the VA reservation
        per_layer = GPU_BYTES // layers // parts // KVCACHED_PAGE * KVCACHED_PAGE
        rows = per_layer // (PAGE * math.prod(row) * 2) * PAGE
    if layout == "kvcached-contiguous":
        whole = torch.empty((rows, layers, parts, *row), dtype=torch.bfloat16, device="meta")
        views = [[whole[:, l, p] for l in range(layers)] for p in range(parts)]
    else:
        views = [[torch.empty((rows, *row), dtype=torch.bfloat16, device="meta") for _ in range(layers)]
                 for _ in range(parts)]
    pool = cls.__new__(cls)
    pool.size, pool.page_size = size, PAGE
    if kv_dim:
        [pool.kv_buffer] = views
    else:
        pool.k_buffer, pool.v_buffer = views
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


BESIDE_MAMBA = {  # the attention pool (200,000 tokens) beside Qwen3.5-4B's Mamba pool (64 slots)
    "qwen35": dict(layers=len(QWEN35_4B.full_attention_layers), heads=QWEN35_4B.kv_heads, head_dim=QWEN35_4B.head_dim),
    # MLA full-attention layers (Kimi-Linear's kind): an MLA pool (kv_buffer, no k_buffer)
    "mla": dict(layers=8, kv_dim=DEEPSEEK_V2_LITE.kv_dim),
    # a pipeline stage with one full-attention layer: counted by the rows it serves like any other
    "one-layer": dict(layers=1, heads=QWEN35_4B.kv_heads, head_dim=QWEN35_4B.head_dim),
}


def beside_mamba(attention, layout):
    return kv_pool(layout, size=200_000, **BESIDE_MAMBA[attention]), mamba_pool(QWEN35_4B, slots=64)


@pytest.mark.parametrize("layout", ELASTIC)
def test_qwen35_mamba_split_equals_native(split, layout):
    elastic = split(14, beside_mamba("qwen35", layout))
    assert elastic == pytest.approx(split(14, beside_mamba("qwen35", "native")), rel=1e-12)
    assert sum(elastic) == pytest.approx(14, abs=1e-12)


def test_qwen35_mamba_host_pool_gets_the_slots_native_gives(split):
    """Slots of the Mamba host pool (MambaPoolHost: host_size * 1e9 // size_per_token)."""
    m = QWEN35_4B
    slot_bytes = len(m.linear_layers) * (math.prod(m.conv_state_shape) * 2 + math.prod(m.temporal_state_shape) * 4)
    slots = {layout: int(split(14, beside_mamba("qwen35", layout))[1] * 1e9 // slot_bytes)
             for layout in ("native", *ELASTIC)}
    assert slots["kvcached-contiguous"] == slots["kvcached-per-layer"] == slots["native"] > 0


@pytest.mark.parametrize("layout", ELASTIC)
@pytest.mark.parametrize("attention", ["mla", "one-layer"])
def test_attention_beside_mamba_split_equals_native(split, attention, layout):
    assert split(14, beside_mamba(attention, layout)) == pytest.approx(split(14, beside_mamba(attention, "native")),
                                                                       rel=1e-12)


@pytest.mark.parametrize("layout", ELASTIC)
def test_swa_split_equals_native(split, layout):
    m = GPT_OSS_20B
    pools = lambda kind: [kv_pool(kind, size=size, layers=m.layers // 2, heads=m.kv_heads, head_dim=m.head_dim)
                          for size in (300_000, 40_000)]  # full attention, sliding window
    native, elastic = split(20, pools("native")), split(20, pools(layout))
    assert elastic == pytest.approx(native, rel=1e-12)
    assert native[0] / native[1] == pytest.approx((300_000 + PAGE) / (40_000 + PAGE))


def test_three_pools_share_by_their_bytes(split):
    """Full attention, sliding window and Mamba (the hybrid SWA + Mamba builder): every
    pool gets its share of the KV it serves."""
    m = QWEN35_4B
    full, window = (kv_pool("kvcached-contiguous", size=size, layers=4, heads=m.kv_heads, head_dim=m.head_dim)
                    for size in (300_000, 40_000))
    mamba = mamba_pool(m, slots=64)
    row = m.kv_heads * m.head_dim * 2 * 2 * 4  # K and V, bf16, 4 layers
    weights = [(300_000 + PAGE) * row, (40_000 + PAGE) * row, mamba.get_kv_size_bytes()]
    shares = split(30, (full, window, mamba))
    assert shares == pytest.approx([30 * w / sum(weights) for w in weights], rel=1e-12)
