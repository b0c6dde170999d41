"""Pipeline-parallel stages for the CPU tier: a stage's device pools and its PP group.

A stage holds layers [start_layer, end_layer), as SGLang's get_pp_indices splits them, in
device pools built for its layers, indexed locally, with both bounds recorded (SGLang's
KVCache attributes; kvcached's elastic pools forward both to it and allocate views for the
local layers only, kvcached/integration/sglang/patches.py ElasticMHATokenToKVPool).

The PP group is what sync_fixed_hicache_size reduces over: one GroupCoordinator-like object
per stage, whose cpu_group is a real gloo process group shared by the stages, run as threads
of this process (parallel_state.get_pp_group is answered per thread).
"""
from __future__ import annotations

import datetime
import threading
from contextlib import contextmanager
from types import SimpleNamespace

import torch.distributed as dist

GROUP_TIMEOUT = datetime.timedelta(seconds=30)


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of a stage, by SGLang's own split (SGLANG_PP_LAYER_PARTITION honoured)."""
    from sglang.srt.distributed.utils import get_pp_indices

    return get_pp_indices(num_layers, pp_rank, pp_size)


def as_stage(pool, start_layer: int, end_layer: int):
    """Record a stage's layer range on a pool built for its end - start local layers."""
    assert pool.layer_num == end_layer - start_layer, "a stage pool holds exactly its layers"
    pool.start_layer, pool.end_layer = start_layer, end_layer
    return pool


@contextmanager
def pp_group(monkeypatch, pp_size: int):
    """Yields run(fn_per_rank): runs fn_per_rank(rank) in one thread per stage, each seeing
    its own PP group from get_pp_group(), and returns their results by rank."""
    from sglang.srt.distributed import parallel_state

    # sync_fixed_hicache_size only reduces once torch.distributed is initialised: a
    # one-rank default group, torn down after.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    store = dist.HashStore()
    local = threading.local()
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: local.group)

    def run(fn):
        results, errors = {}, {}

        def stage(rank):
            try:
                group = dist.ProcessGroupGloo(dist.PrefixStore("pp", store), rank, pp_size, GROUP_TIMEOUT)
                local.group = SimpleNamespace(world_size=pp_size, rank_in_group=rank, cpu_group=group)
                results[rank] = fn(rank)
            except BaseException as exc:  # reported below, in the test's thread
                errors[rank] = exc

        threads = [threading.Thread(target=stage, args=(rank,)) for rank in range(pp_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(2 * GROUP_TIMEOUT.total_seconds())
        assert not any(t.is_alive() for t in threads), "a stage did not finish"
        if errors:
            raise next(iter(errors.values()))
        return results

    try:
        yield run
    finally:
        dist.destroy_process_group()


def hybrid_stage_mappings(full_attention_layers, linear_layers, start_layer, end_layer):
    """The two layer maps _MambaStrategy hands build_hybrid_mamba_stack for a stage, as
    SGLang 0.5.20 builds them: the configurator keeps the stage's global layer ids
    (kv_cache_configurator.py `start_layer <= i < end_layer`), and
    HybridLinearKVPool.full_attention_layer_id_mapping (memory_pool.py:3915) and
    HybridReqToTokenPool.mamba_map (memory_pool.py:1313) key them by those global ids."""
    full = [l for l in full_attention_layers if start_layer <= l < end_layer]
    linear = [l for l in linear_layers if start_layer <= l < end_layer]
    return {g: i for i, g in enumerate(full)}, {g: i for i, g in enumerate(linear)}
