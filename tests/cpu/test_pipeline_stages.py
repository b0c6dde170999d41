"""Pipeline-parallel stages: host pools over a stage's elastic device pools.

A stage with start_layer > 0 holds layers [start, end) in pools built for its local
layers (tests/support/pp_stages.py). Its host pools come from SGLang's builders, over a
ServerArgs parsed from flags, with the layer mapping SGLang's strategies pass; trips go
through HybridCacheController as in test_controller.py. --hicache-size is synced by
SGLang's sync_fixed_hicache_size over a real two-rank gloo group.

Hybrid Mamba stacks under PP lose layers on load in SGLang 0.5.20 itself, on its own
dense pools; the elastic pools must do exactly what native ones do there, byte for
byte, and the test pins what native SGLang does (docs/l3-and-pp.md).
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

from harness.emulation.allocators import PageAllocator, SlotAllocator
from tests.support import controller as ctl
from tests.support import pp_stages as pp
from tests.support.kvcached_views import mamba_pool, mha_pool, mla_pool
from harness.models import DEEPSEEK_V2_LITE, QWEN25_7B, QWEN35_4B
from tests.support.roundtrip import (as_bytes, fill_random, mamba_families, mha_families, mla_families,
                                     pages_to_rows, poison)

PAGE = 16
DEVICE_PAGES = 16       # 6 hold the originals, 10 are load targets
DATA_PAGES = 6
TRIPS = 4
PAGES = list(range(1, DEVICE_PAGES + 1))
LAYOUTS = ("native", "kvcached-contiguous", "kvcached-per-layer")
MODELS = {"MHA": QWEN25_7B, "MLA": DEEPSEEK_V2_LITE}


@pytest.fixture
def controller_env(host_modules, monkeypatch):
    """The controller on CPU; the published config is reset after."""
    from sglang.srt.runtime_context import reset_context

    ctl.run_on_cpu(monkeypatch)
    yield host_modules
    reset_context()


def stage_kv_pool(kind, layout, start, end):
    s, shape = MODELS[kind], dict(size=DEVICE_PAGES * PAGE, page_size=PAGE, layers=end - start)
    if kind == "MLA":
        pool = mla_pool(layout, **shape, kv_lora_rank=s.kv_lora_rank, qk_rope_head_dim=s.qk_rope_head_dim)
    else:
        pool = mha_pool(layout, **shape, heads=s.kv_heads, head_dim=s.head_dim)
    pool.register_layer_transfer_counter = lambda counter: None
    return pp.as_stage(pool, start, end)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_last_stage_round_trips(controller_env, kind, layout):
    """The last of two stages (start_layer > 0): host pools mirror its layers, and backups
    and loads through the controller are byte-exact, with SGLang's defaults."""
    start, end = pp.stage_layers(MODELS[kind].layers, pp_rank=1, pp_size=2)
    assert start > 0
    ctl.publish_server_args("--pipeline-parallel-size", "2")
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    kv = stage_kv_pool(kind, layout, start, end)
    params = ctl.cache_init_params(kv, PageAllocator(kv, PAGES[DATA_PAGES:], PAGE, "cpu", rng))
    # _PlainKvStrategy's mapping: the pool's local layers, {i: i}.
    group, controller = ctl.build_stack(params, kv, use_mla=kind == "MLA", full_layers=range(kv.layer_num))
    host = group.anchor_entry.host_pool
    assert (host.start_layer, host.end_layer, host.layer_num) == (start, end, end - start)
    assert controller.layer_num == end - start
    views = kv.kv_buffer if kind == "MLA" else [*kv.k_buffer, *kv.v_buffer]
    assert any(not view.is_contiguous() for view in views) == (layout == "kvcached-contiguous")
    families = (mla_families if kind == "MLA" else mha_families)(kv, host)
    fill_random(families, pages_to_rows(PAGES, PAGE), generator)
    poison(host.kv_buffer, generator)
    ctl.ControllerRoundTrip(controller, group, families, [], page_size=PAGE, data_pages=PAGES[:DATA_PAGES],
                            scratch_pages=PAGES[DATA_PAGES:], device="cpu").run(TRIPS)


@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_fixed_hicache_size_is_the_minimum_over_the_pp_group(controller_env, monkeypatch, kind):
    """--hicache-size is in bytes, a stage's tokens cost what its layers cost: each stage
    alone sizes a different token count, and SGLang's sync_fixed_hicache_size gives every
    stage of the group the smallest. Stages of 11 and 17 (MHA) / 11 and 16 (MLA) layers."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_kv_host_pool

    num_layers = MODELS[kind].layers
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", f"11,{num_layers - 11}")
    ctl.publish_server_args("--pipeline-parallel-size", "2", "--hicache-size", "1")
    stages = [pp.stage_layers(num_layers, rank, 2) for rank in range(2)]
    assert [end - start for start, end in stages] == [11, num_layers - 11]

    def host_size(rank):
        start, end = stages[rank]
        kv = stage_kv_pool(kind, "kvcached-contiguous", start, end)
        return build_kv_host_pool(kv_pool=kv, page_size=PAGE, use_mla=kind == "MLA").size

    alone = [host_size(rank) for rank in range(2)]   # no PP group: each stage sizes its own
    assert alone[0] > alone[1]
    with pp.pp_group(monkeypatch, 2) as run:
        synced = run(host_size)
    assert synced == {0: alone[1], 1: alone[1]}


# Qwen3.5-4B's layer pattern (full attention every 4th layer) over 16 layers, in stages of 4
# and 12 (hybrid_stages); a smaller GDN state so that the emulated copies stay fast.
HYBRID_LAYERS = 16
HYBRID_FULL = [l for l in range(HYBRID_LAYERS) if l % QWEN35_4B.full_attention_interval == 3]
HYBRID_LINEAR = [l for l in range(HYBRID_LAYERS) if l not in HYBRID_FULL]
GDN_CONV, GDN_SSM = [(96, 3)], (2, 16, 16)


def hybrid_stage_trip(layout, start, end):
    """One backup and one load of a hybrid stage's prefix (2 pages, 1 Mamba slot) through
    the stack SGLang's _MambaStrategy builds. The backup is checked byte-exact for every
    layer. Returns, per family (K, V, Mamba states) and pool layer, the rows loaded back
    and whether they equal the originals."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as asm

    full_map, mamba_map = pp.hybrid_stage_mappings(HYBRID_FULL, HYBRID_LINEAR, start, end)
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    # HybridLinearKVPool keeps the stage's start_layer itself and builds its full-attention
    # pool (what the host pool mirrors) for the stage's full layers, without one.
    kv = mha_pool(layout, size=DEVICE_PAGES * PAGE, page_size=PAGE, layers=len(full_map),
                  heads=QWEN35_4B.kv_heads, head_dim=QWEN35_4B.head_dim)
    kv.register_layer_transfer_counter = lambda counter: None
    mamba = mamba_pool(layout, slots=4, layers=len(mamba_map), conv_shapes=GDN_CONV, temporal_shape=GDN_SSM,
                       page_bytes=64 << 10)
    params = ctl.cache_init_params(kv, PageAllocator(kv, PAGES[DATA_PAGES:], PAGE, "cpu", rng),
                                   SlotAllocator([3, 4], "cpu", rng))
    group, controller = asm.build_hybrid_mamba_stack(
        params=params, kv_pool=kv, mamba_pool=mamba, full_layer_mapping=full_map, mamba_layer_mapping=mamba_map,
        load_cache_event=threading.Event(), storage_backend=None, use_mla=False)
    assert controller.layer_num == end - start
    kv_families = mha_families(kv, group.anchor_entry.host_pool)
    state_families = mamba_families(mamba, group.get_entry(PoolName.MAMBA).host_pool)
    fill_random(kv_families, pages_to_rows(PAGES, PAGE), generator)
    fill_random(state_families, torch.tensor([1, 2, 3, 4]), generator)
    src, slot = pages_to_rows(PAGES[:2], PAGE), torch.tensor([1])

    def rows_of(families, rows):
        return [[as_bytes(view[rows]).clone() for view in family.device] for family in families]

    originals = rows_of(kv_families, src) + rows_of(state_families, slot)
    extra = [PoolTransfer(name=PoolName.MAMBA, device_indices=slot)]
    host = controller.write(src, extra_pools=extra)
    controller.start_writing()
    controller.ack_write_queue[-1].finish_event.synchronize()
    host_slot = extra[0].host_indices
    families = kv_families + state_families
    for family, expected, host_rows in zip(families, originals, [host] * 2 + [host_slot] * len(state_families)):
        for layer, original in enumerate(expected):
            assert torch.equal(as_bytes(family.host(layer)[host_rows]), original), (
                f"{family.name} layer {layer}: the host copy differs from the device rows backed up")
    load_extra = [PoolTransfer(name=PoolName.MAMBA, host_indices=host_slot)]
    dst = controller.load(host, extra_pools=load_extra)
    controller.start_loading()
    controller.ack_load_queue[-1].finish_event.synchronize()
    loaded = rows_of(kv_families, dst) + rows_of(state_families, load_extra[0].device_indices)
    ok = [[torch.equal(got, want) for got, want in zip(*pair)] for pair in zip(loaded, originals)]
    return ok, loaded, [full_map] * 2 + [mamba_map] * len(state_families)


@pytest.fixture
def hybrid_stages(controller_env, monkeypatch):
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "4,12")  # the second stage holds layers [4, 16)
    ctl.publish_server_args("--pipeline-parallel-size", "2")
    return [pp.stage_layers(HYBRID_LAYERS, rank, 2) for rank in range(2)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hybrid_first_stage_loads_every_layer(hybrid_stages, layout):
    start, end = hybrid_stages[0]
    assert start == 0
    ok, _, _ = hybrid_stage_trip(layout, start, end)
    assert all(all(layers) for layers in ok)


def test_hybrid_later_stage_loads_what_native_sglang_loads(hybrid_stages):
    """start_layer > 0: SGLang 0.5.20 keys the hybrid layer maps by global layer id and
    walks local ids on load (_make_layer_mapper), so a layer whose global id is not below
    the stage's layer count is never loaded back, on its own dense pools too. Elastic
    pools load exactly the same bytes as native ones; which layers native loads is
    pinned so that a change in SGLang shows here (docs/l3-and-pp.md)."""
    start, end = hybrid_stages[1]
    native_ok, native_rows, maps = hybrid_stage_trip("native", start, end)
    for layout in LAYOUTS[1:]:
        ok, rows, _ = hybrid_stage_trip(layout, start, end)
        assert ok == native_ok, f"{layout}: other layers load than natively"
        assert all(torch.equal(got, want) for family_rows, family_native in zip(rows, native_rows)
                   for got, want in zip(family_rows, family_native)), f"{layout}: loaded bytes differ from native"
    assert native_ok == [[global_id < end - start for global_id in layer_map] for layer_map in maps]
    assert not all(all(layers) for layers in native_ok)  # SGLang 0.5.20 drops layers here
