"""The device pools and the SGLang entry point of every differential scenario.

A scenario is a model's device pools (SGLang's own classes, built on the runner's
device with small sizes and the model's head geometry, fewer layers) plus the SGLang
function that builds its host pools, exactly as a server would call it:

* ``unified``: ``attach_hybrid_pool_to_unified_cache`` (picks a StackStrategy from the
  pool type and components, which calls the stack, group and host-pool builders);
* ``hiradix-dsa`` / ``hiradix-minimax``: the two HiRadixCache attach functions;
* ``draft-sidecar``: ``unified`` for the target model, then
  ``build_hicache_draft_sidecars`` for its draft model's pool (MTP/EAGLE drafts kept
  beside the target's host pool).

The runner crosses every scenario with every host layout and io backend SGLang's
argument parser accepts. Shapes are the published configs' (harness/models.py
where it has them); layer counts are cut to keep the emulated copies fast.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

from harness.emulation.allocators import PageAllocator, SlotAllocator
from harness.differential.steps import TRIP_PAGES, TRIPS
from harness.models import GPT_OSS_20B, QWEN25_7B, QWEN35_4B

PAGE = 16
DEVICE_PAGES = 10      # page 0 is SGLang's padding page; pages 1-4 hold data, 5-10 are load targets
DATA_PAGES = 4
SLOTS = 6              # Mamba slots 1-6 (slot 0 is the null slot): 1-2 hold data
DATA_SLOTS = 2
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


@dataclass
class Pools:
    """What a scenario hands the entry point. `data` maps a pool name to the device rows
    that hold data (backed up by trips); each allocator hands out the other rows."""

    kvcache: object
    components: tuple[str, ...]
    allocator: object
    page_size: int
    req_to_token_pool: object = None
    mtp_draft_device_pools: tuple = ()
    draft_device_pools: tuple = ()
    data: dict = field(default_factory=dict)
    units: dict = field(default_factory=dict)   # rows per allocation unit (page or slot) per pool
    trip_pages: int = TRIP_PAGES                # KV pages a trip backs up and loads


@dataclass(frozen=True)
class Scenario:
    name: str
    entry: str
    pools: Callable[["Context"], Pools]
    flags: tuple[str, ...] = ()
    # get_parallel().override(...) while the pools are built: the ranks and groups a
    # multi-GPU server would have, as this one process stands for one of its ranks.
    parallel: dict = field(default_factory=dict)
    # A flag variant of another scenario (--hicache-size): construct and sizes only,
    # with SGLang's default layout and io backend. The other scenario crosses every
    # layout and io backend and moves the bytes; --hicache-size is whole gigabytes,
    # and copying and hashing gigabyte host pools would add nothing but time.
    sizes_only: bool = False


@dataclass
class Context:
    device: str
    rng: random.Random


def rows(pages, page_size):
    base = torch.as_tensor(list(pages), dtype=torch.int64)[:, None] * page_size
    return (base + torch.arange(page_size, dtype=torch.int64)[None, :]).reshape(-1)


def _pages(ctx, kv, page_size, pages=DEVICE_PAGES, data_pages=DATA_PAGES):
    allocator = PageAllocator(kv, range(data_pages + 1, pages + 1), page_size, ctx.device, ctx.rng)
    return allocator, rows(range(1, data_pages + 1), page_size).to(ctx.device)


def _mp():
    from sglang.srt.mem_cache import memory_pool

    return memory_pool


def mha(ctx, *, heads, head_dim, layers, dtype=BF16, v_head_dim=None, page_size=PAGE, pages=DEVICE_PAGES):
    return _mp().MHATokenToKVPool(size=pages * page_size, page_size=page_size, dtype=dtype, head_num=heads,
                                  head_dim=head_dim, v_head_dim=v_head_dim, layer_num=layers, device=ctx.device,
                                  enable_memory_saver=False)


def mla(ctx, *, layers, dtype=BF16, page_size=PAGE, cls=None, pages=DEVICE_PAGES, **kwargs):
    cls = cls or _mp().MLATokenToKVPool
    return cls(size=pages * page_size, page_size=page_size, dtype=dtype, kv_lora_rank=512,
               qk_rope_head_dim=64, layer_num=layers, device=ctx.device, enable_memory_saver=False, **kwargs)


DSA_PAGE = 64  # DSATokenToKVPool asserts page_size == 64 outside HIP/XPU


def dsa(ctx, *, layers, cls=None, **kwargs):
    """DeepSeek-V3.2's DSA pool: MLA latent 512 + rope 64, fp8 with per-128 scales
    (kv_cache_dim 656), indexer head 128."""
    cls = cls or _mp().DSATokenToKVPool
    return cls(size=DEVICE_PAGES * DSA_PAGE, page_size=DSA_PAGE, kv_lora_rank=512, dtype=FP8,
               qk_rope_head_dim=64, layer_num=layers, device=ctx.device, index_head_dim=128,
               enable_memory_saver=False, kv_cache_dim=512 + 512 // 128 * 4 + 64 * 2, **kwargs)


def plain(kv_factory, *, drafts=0, draft_factory=None):
    """One KV pool (MHA, MLA, DSA, ...); `drafts` packed MTP draft pools of one layer."""

    def build(ctx):
        kv = kv_factory(ctx)
        allocator, data = _pages(ctx, kv, kv.page_size)
        mtp = tuple(draft_factory(ctx) for _ in range(drafts))
        return Pools(kvcache=kv, components=("FULL",), allocator=allocator, page_size=kv.page_size,
                     mtp_draft_device_pools=mtp, data={"kv": data})
    return build


# The page_first write-back stages at most 64 pages a launch (pool_host/base.py:
# _WRITE_BACK_STAGING_PAGE_CHUNK); a trip of more takes several launches.
LONG_TRIP_PAGES = 72


def long_trips(kv_factory):
    """One KV pool whose trips back up LONG_TRIP_PAGES pages at once: data pages to
    pick them from, and free pages for every trip's load."""

    def build(ctx):
        data_pages = LONG_TRIP_PAGES + 1
        pages = data_pages + TRIPS * LONG_TRIP_PAGES
        kv = kv_factory(ctx, pages)
        allocator, data = _pages(ctx, kv, kv.page_size, pages=pages, data_pages=data_pages)
        return Pools(kvcache=kv, components=("FULL",), allocator=allocator, page_size=kv.page_size,
                     data={"kv": data}, trip_pages=LONG_TRIP_PAGES)
    return build


def with_draft(target_factory, draft_factory):
    """A target model and the draft model kept as a host sidecar."""

    def build(ctx):
        pools = target_factory(ctx)
        pools.draft_device_pools = (draft_factory(ctx),)
        return pools
    return build


def swa(*, heads, head_dim, full_layers, swa_layers, v_head_dim=None, swa_heads=None, mamba=None):
    """SGLang's SWAKVPool (full + sliding-window MHA sub-pools); with `mamba`, plus a
    Mamba pool (the FULL + SWA + MAMBA strategy)."""

    def build(ctx):
        kwargs = {}
        if v_head_dim is not None:
            kwargs["v_head_dim"] = v_head_dim
        if swa_heads is not None:
            kwargs["swa_head_num"] = swa_heads
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        size = DEVICE_PAGES * PAGE
        kv = SWAKVPool(size=size, size_swa=size, page_size=PAGE, dtype=BF16, head_num=heads, head_dim=head_dim,
                       swa_attention_layer_ids=list(swa_layers), full_attention_layer_ids=list(full_layers),
                       device=ctx.device, **kwargs)
        full, data = _pages(ctx, kv.full_kv_pool, PAGE)
        swa_alloc, swa_data = _pages(ctx, kv.swa_kv_pool, PAGE)
        allocator = SimpleNamespace(get_kvcache=lambda: kv, full_attn_allocator=full, swa_attn_allocator=swa_alloc,
                                    alloc=full.alloc, free=full.free, page_size=PAGE)
        pools = Pools(kvcache=kv, components=("FULL", "SWA"), allocator=allocator, page_size=PAGE,
                      data={"kv": data, "swa": swa_data}, units={"swa": PAGE})
        if mamba is not None:
            pools.components += ("MAMBA",)
            _add_mamba(ctx, pools, mamba, linear_layers=mamba[1])
        return pools
    return build


# Qwen3.5-4B's GDN state (conv 8192 x 3 bf16, SSM 32 x 128 x 128 fp32) is 2.1 MiB a slot
# and layer; the emulated copies move it byte for byte, so the CPU scenarios keep its
# layer pattern and dtypes and shrink the state to 1/16 (heads 32 -> 2 per kind).
GDN_STATE = dict(intermediate_size=2 * 128, n_groups=1, num_heads=2, head_dim=128, state_size=128,
                 conv_kernel=QWEN35_4B.linear_conv_kernel_dim)


def _mamba_pool(ctx, linear_layers):
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape

    shape = Mamba2StateShape.create(tp_world_size=1, **GDN_STATE)
    params = Mamba2CacheParams(shape=shape, layers=list(linear_layers),
                               dtype=Mamba2StateDType(conv=BF16, temporal=torch.float32))
    return _mp().MambaPool(size=SLOTS, spec_state_size=SLOTS, cache_params=params,
                           mamba_layer_ids=list(range(len(linear_layers))), device=ctx.device)


def _add_mamba(ctx, pools, mamba, *, linear_layers):
    mamba_pool = mamba[0](ctx, linear_layers)
    slots = SlotAllocator(range(DATA_SLOTS + 1, SLOTS + 1), ctx.device, ctx.rng)
    pools.req_to_token_pool = SimpleNamespace(
        mamba_pool=mamba_pool, mamba_map={layer: i for i, layer in enumerate(linear_layers)},
        mamba_allocator=slots, register_layer_transfer_counter=lambda counter: None)
    pools.data["mamba"] = torch.arange(1, DATA_SLOTS + 1, dtype=torch.int64, device=ctx.device)
    pools.units["mamba"] = 1


def hybrid_mamba(*, layers, full_interval, heads, head_dim):
    """Qwen3.5: HybridLinearKVPool (full-attention MHA layers) + MambaPool (GDN layers)."""

    def build(ctx):
        full_layers = [l for l in range(layers) if (l + 1) % full_interval == 0]
        linear_layers = [l for l in range(layers) if l not in full_layers]
        mamba_pool = _mamba_pool(ctx, linear_layers)
        kv = _mp().HybridLinearKVPool(size=DEVICE_PAGES * PAGE, dtype=BF16, page_size=PAGE, head_num=heads,
                                      head_dim=head_dim, full_attention_layer_ids=full_layers, device=ctx.device,
                                      mamba_pool=mamba_pool)
        allocator, data = _pages(ctx, kv.full_kv_pool, PAGE)
        allocator.get_kvcache = lambda: kv
        pools = Pools(kvcache=kv, components=("FULL", "MAMBA"), allocator=allocator, page_size=PAGE,
                      data={"kv": data})
        _add_mamba(ctx, pools, (lambda ctx, _layers: mamba_pool, linear_layers), linear_layers=linear_layers)
        return pools
    return build


def minimax(*, index_k):
    """MiniMax-M3-style sparse pool: dense MHA layers plus sparse layers whose index
    branch keeps K only (`index_k`), or no sparse layers at all."""

    def build(ctx):
        kv = _mp().MiniMaxSparseKVPool(
            size=DEVICE_PAGES * PAGE, page_size=PAGE, dtype=BF16, head_num=8, head_dim=128, idx_head_dim=128,
            dense_layer_ids=[0, 2] if index_k else [0, 1, 2], sparse_layer_ids=[1] if index_k else [],
            disable_value_sparse_layer_ids=[1] if index_k else [], device=ctx.device, start_layer=0, end_layer=3)
        allocator, data = _pages(ctx, kv.main_pool, PAGE)
        allocator.get_kvcache = lambda: kv
        return Pools(kvcache=kv, components=("FULL",), allocator=allocator, page_size=PAGE, data={"kv": data})
    return build


def deepseek_v4(ctx):
    """SGLang's DeepSeekV4TokenToKVPool: full-attention, C4 and C128 compressed layers
    (compression ratios 0, 4, 128, 4), SWA ring, C4 indexer and compress states; fp8,
    latent 448 + rope 64, indexer head 128, tree pages of 256, SWA pages of 128."""
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import (DeepSeekV4TokenToKVPool,
                                                               get_compress_state_ring_size)

    page, swa_page = 256, 128
    swa_size = DEVICE_PAGES * page
    # The C4 states are addressed by SWA page (HiCache moves them with the SWA indices):
    # one ring per SWA page, as SGLang's pool configurator sizes them. Fewer rows and
    # a load into a high SWA page writes past the state buffers (a GPU faults later).
    c4_state_pool_size = swa_size // swa_page * get_compress_state_ring_size(4)
    kv = DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=swa_size, c4_size=DEVICE_PAGES * page, c128_size=DEVICE_PAGES * 8,
        c4_state_pool_size=c4_state_pool_size, c128_state_pool_size=64, page_size=page, swa_page_size=swa_page,
        dtype=FP8,
        c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64,
        indexer_head_dim=128, layer_num=4, start_layer=0, end_layer=4, device=ctx.device, enable_memory_saver=False,
        compression_ratios=[0, 4, 128, 4])
    full, data = _pages(ctx, kv, page)
    swa_alloc, swa_data = _pages(ctx, kv.swa_kv_pool, swa_page)
    allocator = SimpleNamespace(get_kvcache=lambda: kv, full_attn_allocator=full, swa_attn_allocator=swa_alloc,
                                alloc=full.alloc, free=full.free, page_size=page, size_full=DEVICE_PAGES * page)
    return Pools(kvcache=kv, components=("FULL", "SWA"), allocator=allocator, page_size=page,
                 data={"kv": data, "swa": swa_data}, units={"swa": swa_page})


def swa_with_draft(target, *, heads, head_dim):
    """A SWA model and its one-layer sliding-window draft model (EAGLE on gpt-oss)."""

    def build(ctx):
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        pools = target(ctx)
        size = DEVICE_PAGES * PAGE
        pools.draft_device_pools = (SWAKVPool(size=size, size_swa=size, page_size=PAGE, dtype=BF16, head_num=heads,
                                              head_dim=head_dim, swa_attention_layer_ids=[0],
                                              full_attention_layer_ids=[], device=ctx.device),)
        return pools
    return build


QWEN = dict(heads=QWEN25_7B.kv_heads, head_dim=QWEN25_7B.head_dim, layers=3)
LLAMA3_8B = dict(heads=8, head_dim=128, layers=3)          # Llama-3-8B: 8 KV heads x 128
MIMO_V2 = dict(heads=4, head_dim=192, v_head_dim=128, layers=3)  # MiMo-V2-Flash: K 192, V 128


def _m(**shape):
    return lambda ctx: mha(ctx, **shape)


def _l(**kwargs):
    return lambda ctx: mla(ctx, layers=3, **kwargs)


def _npu_mla(ctx):
    from sglang.srt.hardware_backend.npu.memory_pool_npu import NPUMLATokenToKVPool

    return mla(ctx, layers=3, cls=NPUMLATokenToKVPool)


def _layer_split(ctx):
    from sglang.srt.mem_cache.dsa_cache_layer_split import LayerSplitDSATokenToKVPool

    return dsa(ctx, layers=4, cls=LayerSplitDSATokenToKVPool, layer_shard_rank=0, layer_shard_size=2)


GPT_OSS = dict(heads=GPT_OSS_20B.kv_heads, head_dim=GPT_OSS_20B.head_dim, full_layers=[1, 3], swa_layers=[0, 2])

SCENARIOS = [
    Scenario("mha/qwen2.5-7b/bf16", "unified", plain(_m(**QWEN))),
    Scenario("mha/llama-3-8b/bf16", "unified", plain(_m(**LLAMA3_8B))),
    Scenario("mha/llama-3-8b/fp8", "unified", plain(_m(**LLAMA3_8B, dtype=FP8))),
    Scenario("mha-asymmetric/mimo-v2/bf16", "unified", plain(_m(**MIMO_V2))),
    Scenario("mha-long-trips/qwen2.5-7b/bf16", "unified", long_trips(lambda ctx, pages: mha(ctx, **QWEN, pages=pages))),
    Scenario("mla/deepseek-v3/bf16", "unified", plain(_l())),
    Scenario("mla/deepseek-v3/fp8", "unified", plain(_l(dtype=FP8))),
    Scenario("mla-long-trips/deepseek-v3/bf16", "unified", long_trips(lambda ctx, pages: mla(ctx, layers=3, pages=pages))),
    Scenario("mla-ascend-shaped/deepseek-v3/bf16", "unified", plain(_npu_mla)),
    Scenario("mla-dcp2/deepseek-v3/bf16", "unified", plain(_l()), flags=("--dcp-size", "2"),
             parallel={"attn_dcp_rank": 1}),
    Scenario("dsa/deepseek-v3.2/fp8", "unified", plain(lambda ctx: dsa(ctx, layers=3))),
    Scenario("dsa-hiradix/deepseek-v3.2/fp8", "hiradix-dsa", plain(lambda ctx: dsa(ctx, layers=3))),
    Scenario("dsa-layer-split/deepseek-v3.2/fp8", "unified", plain(_layer_split),
             parallel={"attn_cp_group": SimpleNamespace(world_size=1, pynccl_comm=None)}),
    Scenario("mtp-packed/qwen2.5-7b/bf16", "unified",
             plain(_m(**QWEN), drafts=1, draft_factory=_m(**{**QWEN, "layers": 1}))),
    Scenario("mtp-packed/deepseek-v3/bf16", "unified",
             plain(_l(), drafts=1, draft_factory=lambda ctx: mla(ctx, layers=1))),
    Scenario("mtp-packed/deepseek-v3.2/fp8", "unified",
             plain(lambda ctx: dsa(ctx, layers=3), drafts=1, draft_factory=lambda ctx: dsa(ctx, layers=1))),
    Scenario("draft-sidecar/qwen2.5-7b/bf16", "draft-sidecar",
             with_draft(plain(_m(**QWEN)), _m(**{**QWEN, "layers": 1}))),
    Scenario("draft-sidecar/deepseek-v3/bf16", "draft-sidecar",
             with_draft(plain(_l()), lambda ctx: mla(ctx, layers=1))),
    Scenario("draft-sidecar/deepseek-v3.2/fp8", "draft-sidecar",
             with_draft(plain(lambda ctx: dsa(ctx, layers=3)), lambda ctx: dsa(ctx, layers=1))),
    Scenario("swa/gpt-oss-20b/bf16", "unified", swa(**GPT_OSS)),
    Scenario("swa/gpt-oss-20b/bf16/hicache-size", "unified", swa(**GPT_OSS), flags=("--hicache-size", "1"),
             sizes_only=True),
    Scenario("draft-sidecar/gpt-oss-20b/bf16", "draft-sidecar",
             swa_with_draft(swa(**GPT_OSS), heads=GPT_OSS["heads"], head_dim=GPT_OSS["head_dim"])),
    Scenario("deepseek-v4/fp8", "unified", deepseek_v4),
    Scenario("swa-asymmetric/mimo-v2/bf16", "unified",
             swa(heads=4, head_dim=192, v_head_dim=128, swa_heads=8, full_layers=[3], swa_layers=[0, 1, 2])),
    Scenario("hybrid-mamba/qwen3.5-4b", "unified",
             hybrid_mamba(layers=4, full_interval=4, heads=QWEN35_4B.kv_heads, head_dim=QWEN35_4B.head_dim)),
    Scenario("hybrid-mamba/qwen3.5-4b/hicache-size", "unified",
             hybrid_mamba(layers=4, full_interval=4, heads=QWEN35_4B.kv_heads, head_dim=QWEN35_4B.head_dim),
             flags=("--hicache-size", "1"), sizes_only=True),
    Scenario("mamba-swa/gdn+gpt-oss", "unified", swa(**GPT_OSS, mamba=(_mamba_pool, [4, 5]))),
    Scenario("minimax-sparse/index-k", "unified", minimax(index_k=True)),
    Scenario("minimax-sparse-hiradix/index-k", "hiradix-minimax", minimax(index_k=True)),
    Scenario("minimax-sparse-hiradix/dense", "hiradix-minimax", minimax(index_k=False)),
]
