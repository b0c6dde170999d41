"""A kvcached 0.1.6 workaround that the transfer benchmark and the GPU tier share: building
an elastic MLA pool in a kvcached group of its own (kvcached and SGLang imported only when
it is used, on a CUDA machine)."""
from __future__ import annotations

import contextlib
import functools


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
    from sglang.srt.mem_cache import memory_pool as mp

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
