"""SGLang's defaults, end to end below the server: ServerArgs -> assembler -> controller.

Each case publishes `--enable-hierarchical-cache` (plus the flags it names), SGLang's own
stack builders build the host pools and the HybridCacheController over kvcached-shaped
device pools, and trips go through the controller as the radix cache drives it, with the
exact kernel emulators and torch.cpu's streams (tests/support/controller.py).

With no extra flag this is SGLang's default HiCache: host layout page_first, io backend
kernel, write policy write_through. On SGLang 0.5.20 without the series the default
configuration fails here for every kvcached case (MHA: AttributeError on the first
backup; MLA and Mamba: wrong bytes).
"""
from __future__ import annotations

import random

import pytest
import torch

from harness.emulation.allocators import PageAllocator, SlotAllocator
from tests.support import controller as ctl
from tests.support.kvcached_views import mamba_pool, mha_pool, mla_pool
from harness.models import DEEPSEEK_V2_LITE, QWEN25_7B, QWEN35_4B
from tests.support.roundtrip import fill_random, mamba_families, mha_families, mla_families, pages_to_rows, poison

PAGE = 16
DEVICE_PAGES = 24       # 8 hold the originals, 16 are load targets
DATA_PAGES = 8
PAGES = list(range(1, DEVICE_PAGES + 1))  # page 0 holds SGLang's padding token
SLOTS = list(range(1, 11))  # hybrid: slot 0 is kvcached's null slot; 4 hold the originals
DATA_SLOTS = 4
TRIPS = 12
KVCACHED = ("kvcached-contiguous", "kvcached-per-layer")

# Qwen3.5-4B's layer pattern and attention shape, fewer layers and a smaller GDN state
# so that the emulated copies stay fast (the GPU tier runs the real shapes).
HYBRID_LAYERS = 8
HYBRID_FULL = [l for l in range(HYBRID_LAYERS) if l % QWEN35_4B.full_attention_interval == 3]
HYBRID_LINEAR = [l for l in range(HYBRID_LAYERS) if l not in HYBRID_FULL]
GDN_CONV, GDN_SSM = [(96, 3)], (2, 16, 16)
MAMBA = "mamba"  # PoolName.MAMBA (a str enum), named without importing SGLang at collection


@pytest.fixture
def controller_env(host_modules, monkeypatch):
    """The controller on CPU (tests/support/controller.py); the published config is reset after."""
    from sglang.srt.runtime_context import reset_context

    ctl.run_on_cpu(monkeypatch)
    yield host_modules
    reset_context()


def kv_device_pool(kind, layout):
    size = DEVICE_PAGES * PAGE
    if kind == "MLA":
        s = DEEPSEEK_V2_LITE
        pool = mla_pool(layout, size=size, page_size=PAGE, layers=s.layers, kv_lora_rank=s.kv_lora_rank,
                        qk_rope_head_dim=s.qk_rope_head_dim)
    else:
        s, layers = (QWEN25_7B, QWEN25_7B.layers) if kind == "MHA" else (QWEN35_4B, len(HYBRID_FULL))
        pool = mha_pool(layout, size=size, page_size=PAGE, layers=layers, heads=s.kv_heads, head_dim=s.head_dim)
    pool.register_layer_transfer_counter = lambda counter: None
    return pool


def build(kind, layout, flags):
    """Publish the flags and build the stack over kvcached-shaped pools: (kv, mamba, group, controller)."""
    ctl.publish_server_args(*flags)
    rng = random.Random(0)
    kv = kv_device_pool(kind, layout)
    allocator = PageAllocator(kv, PAGES[DATA_PAGES:], PAGE, "cpu", rng)
    mamba = slot_allocator = None
    if kind == "hybrid":
        mamba = mamba_pool(layout, slots=len(SLOTS), layers=len(HYBRID_LINEAR), conv_shapes=GDN_CONV,
                           temporal_shape=GDN_SSM, page_bytes=64 << 10)
        slot_allocator = SlotAllocator(SLOTS[DATA_SLOTS:], "cpu", rng)
    group, controller = ctl.build_stack(ctl.cache_init_params(kv, allocator, slot_allocator), kv,
                                        use_mla=kind == "MLA",
                                        full_layers=HYBRID_FULL if kind == "hybrid" else range(kv.layer_num),
                                        mamba_pool=mamba, linear_layers=HYBRID_LINEAR)
    return kv, mamba, group, controller


def run(kind, layout, flags=()):
    """Build the stack from published flags and run trips; returns (group, controller)."""
    kv, mamba, group, controller = build(kind, layout, flags)
    generator = torch.Generator().manual_seed(0)
    host = group.anchor_entry.host_pool
    kv_families = (mla_families if kind == "MLA" else mha_families)(kv, host)
    fill_random(kv_families, pages_to_rows(PAGES, PAGE), generator)
    poison(host.kv_buffer, generator)
    state_families, slots = [], ()
    if mamba is not None:
        slots, mamba_host = SLOTS, group.get_pool(MAMBA)
        state_families = mamba_families(mamba, mamba_host)
        fill_random(state_families, torch.tensor(slots), generator)
        for buffer in (mamba_host.temporal_buffer, *mamba_host.conv_buffer):
            poison(buffer, generator)
    ctl.ControllerRoundTrip(controller, group, kv_families, state_families, page_size=PAGE,
                            data_pages=PAGES[:DATA_PAGES], scratch_pages=PAGES[DATA_PAGES:],
                            data_slots=slots[:DATA_SLOTS], scratch_slots=slots[DATA_SLOTS:], device="cpu").run(TRIPS)
    return group, controller


@pytest.mark.parametrize("layout", ["native", *KVCACHED])
@pytest.mark.parametrize("kind", ["MHA", "MLA", "hybrid"])
def test_defaults_back_up_and_load_through_the_controller(controller_env, kind, layout):
    group, controller = run(kind, layout)
    # What --enable-hierarchical-cache alone gives, unchanged by the series.
    assert group.anchor_entry.host_pool.layout == "page_first"
    assert controller.io_backend == "kernel"
    assert controller.write_policy == "write_through"
    if kind == "hybrid":
        assert group.get_pool(MAMBA).layout == "page_first"
        assert controller.layer_num == HYBRID_LAYERS


@pytest.mark.parametrize("layout", KVCACHED)
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
@pytest.mark.parametrize("flags", [
    ("--hicache-mem-layout", "layer_first"),
    ("--hicache-mem-layout", "layer_first", "--hicache-io-backend", "direct"),
], ids=["layer_first", "layer_first+direct"])
def test_other_supported_flags_through_the_controller(controller_env, kind, layout, flags):
    group, controller = run(kind, layout, flags)
    assert group.anchor_entry.host_pool.layout == flags[1]


def test_page_first_direct_through_the_controller_where_views_are_dense(controller_env):
    """sglang-kernel's page_first_direct copies serve dense views: kvcached's per-layer
    MHA pool (the hybrid Mamba state, strided in both layouts, is refused there)."""
    group, controller = run("MHA", "kvcached-per-layer",
                            ("--hicache-mem-layout", "page_first_direct", "--hicache-io-backend", "direct"))
    assert controller.io_backend == "direct"


@pytest.mark.parametrize("kind,flags", [
    ("MHA", ("--hicache-mem-layout", "page_head")),
    ("MLA", ("--hicache-mem-layout", "page_head")),
    ("MHA", ("--hicache-mem-layout", "page_first_direct", "--hicache-io-backend", "direct")),
    ("MLA", ("--hicache-mem-layout", "page_first_direct", "--hicache-io-backend", "direct")),
    ("hybrid", ("--hicache-mem-layout", "page_first_direct", "--hicache-io-backend", "direct")),
])
def test_unserved_layouts_are_refused_when_the_stack_is_built(controller_env, kind, flags):
    """The refusal reaches the operator from SGLang's own builder, before any request."""
    with pytest.raises(ValueError, match="page_head|page_first_direct"):
        build(kind, "kvcached-contiguous", flags)


def hybrid_host_sizes(layout, flags):
    """(KV host tokens, Mamba host slots) as SGLang's builder sizes them for this layout."""
    _, _, group, _ = build("hybrid", layout, flags)
    try:
        return group.anchor_entry.host_pool.size, group.get_pool(MAMBA).size
    finally:
        ctl.release_host_pools(group)


@pytest.mark.parametrize("flags", [("--hicache-size", "1"), ()], ids=["hicache-size", "hicache-ratio"])
@pytest.mark.parametrize("layout", KVCACHED)
def test_host_pools_are_sized_as_natively_through_the_builder(controller_env, layout, flags):
    """--hicache-size (split between the pools) and --hicache-ratio give an elastic
    hybrid model exactly the host pools the same model gets on native pools."""
    native = hybrid_host_sizes("native", flags)
    assert hybrid_host_sizes(layout, flags) == native
    if flags:  # the 1 GB budget is shared by logical capacity, not starved
        kv_tokens, mamba_slots = native
        assert mamba_slots > 1000 and kv_tokens > 100_000
