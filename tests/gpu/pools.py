"""kvcached 0.1.6's real elastic pools with the model shapes the GPU tier uses.

kvcached's autopatch (tests/gpu/conftest.py) turns SGLang's pool classes into its
elastic ones; each builder asserts that it did, and waits for kvcached's post-init
(0.1.6: an alloc before it finishes deadlocks).
"""
from __future__ import annotations

import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.mem_cache import memory_pool as mp

from harness.kvcached_groups import own_kvcached_group

PAGE = 64
DEVICE_PAGES = 64  # 4096 tokens; tests use 48 allocated pages


def elastic(pool):
    assert type(pool).__name__.startswith("Elastic"), f"not a kvcached pool: {type(pool).__name__}"
    pool.kvcached_allocator._wait_post_init()
    return pool


def mha_pool(shape, layers=None, pages=DEVICE_PAGES):
    return elastic(mp.MHATokenToKVPool(size=pages * PAGE, page_size=PAGE, dtype=torch.bfloat16,
                                       head_num=shape.kv_heads, head_dim=shape.head_dim,
                                       layer_num=layers or shape.layers, device="cuda",
                                       enable_memory_saver=False))


def mla_pool(shape, layers=None, pages=DEVICE_PAGES):
    return elastic(mp.MLATokenToKVPool(size=pages * PAGE, page_size=PAGE, dtype=torch.bfloat16,
                                       kv_lora_rank=shape.kv_lora_rank, qk_rope_head_dim=shape.qk_rope_head_dim,
                                       layer_num=layers or shape.layers, device="cuda",
                                       enable_memory_saver=False))


def mla_pool_of_its_own(shape, layers=None, pages=DEVICE_PAGES):
    """mla_pool, in a kvcached group no other pool uses (harness/kvcached_groups.py)."""
    with own_kvcached_group() as group:
        pool = mla_pool(shape, layers, pages)
    assert pool.kvcached_allocator.group_id == group, "kvcached ignored the group id"
    return pool


def gdn_pool(model, slots=24):
    """The Mamba pool of a GDN model's linear-attention layers (conv bf16, SSM fp32)."""
    shape = Mamba2StateShape.create(**model.state_shape_kwargs())
    assert tuple(shape.conv[0]) == model.conv_state_shape and tuple(shape.temporal) == model.temporal_state_shape
    params = Mamba2CacheParams(shape=shape, layers=model.linear_layers,
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
    return elastic(mp.MambaPool(size=slots, spec_state_size=slots, cache_params=params,
                                mamba_layer_ids=list(range(len(model.linear_layers))), device="cuda"))
