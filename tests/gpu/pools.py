"""kvcached 0.1.6's real elastic pools with the model shapes the GPU tier uses.

kvcached's autopatch (tests/gpu/conftest.py) turns SGLang's pool classes into its
elastic ones; each builder asserts that it did, and waits for kvcached's post-init
(0.1.6: an alloc before it finishes deadlocks).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.mem_cache import memory_pool as mp

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


@contextlib.contextmanager
def own_kvcached_group():
    """Within, kvcached builds a pool in a group no other pool uses.

    kvcached keeps one FTensorAllocator (KV tensors and page space) per group id and maps
    a pool's pages into its group's tensors (kvcached 0.1.6: csrc/allocator.cpp:108-121,
    page_allocator.cpp:747-772). Its elastic MHA pool takes a fresh group from a class
    counter that starts at 0 (integration/sglang/patches.py:806-809); its elastic MLA
    pool passes no group id to alloc_kv_cache nor to get_kv_cache_manager
    (patches.py:1185-1212), so every MLA pool lands in group 0, with every other MLA
    pool and the process's first MHA pool. create_kv_tensors on a group that has
    tensors replaces them (the check that the layer counts match is an assert(),
    compiled out of the release build: allocator.cpp:134):
    - contiguous layout: the newcomer's FTensor takes the group's place
      (allocator.cpp:561); the old one's destructor unmaps and frees its virtual range
      (ftensor.cpp:105-118) while the first pool's views still point there, so the next
      write to them is an illegal address;
    - per-layer layout: the newcomer gets the first pool's per-layer FTensors back
      (allocator.cpp:577-584) and its views do not fit them (RuntimeError: shape
      [...] is invalid, interfaces.py:196).
    An MLA model with an MTP draft builds two MLA pools in one process, so a server
    meets this too. Here the pool gets a group id from the MHA pool's counter (never 0,
    kvcached's default), passed to both calls.
    """
    import kvcached.integration.sglang.interfaces as kvi

    counter = mp.ElasticMHATokenToKVPool
    group = max(counter._next_group_id, 1)
    counter._next_group_id = group + 1
    alloc, manager = kvi.alloc_kv_cache, kvi.get_kv_cache_manager
    kvi.alloc_kv_cache = functools.partial(alloc, group_id=group)
    kvi.get_kv_cache_manager = functools.partial(manager, group_id=group)
    try:
        yield group
    finally:
        kvi.alloc_kv_cache, kvi.get_kv_cache_manager = alloc, manager


def mla_pool_of_its_own(shape, layers=None, pages=DEVICE_PAGES):
    """mla_pool, in a kvcached group no other pool uses (see own_kvcached_group)."""
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
