"""L3 storage below elastic device pools: a real Mooncake store, and SGLang's file backend.

Each case publishes `--hicache-storage-backend mooncake|file` with the host layout it
names, builds the stack with SGLang's own builder (which attaches the backend and starts
the controller's storage threads), and runs trips from kvcached-shaped device pools to
the store and back (tests/support/l3_storage.py): byte-exact, no other byte changed.

The Mooncake cases run mooncake-transfer-engine's non-CUDA build (requirements/cpu.txt;
it needs Debian's libibverbs1, which .ci/run installs): a mooncake_master with its HTTP
metadata server on loopback ports, started here and stopped after the module, and
SGLang's MooncakeStore as its client over TCP, zero-copy from host pools that
MooncakeHostMemAllocator allocates (SGLang picks that allocator for this backend).
"""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from harness.emulation.allocators import PageAllocator
from tests.support import controller as ctl
from tests.support import l3_storage as l3
from tests.support.kvcached_views import mha_pool, mla_pool
from harness.models import DEEPSEEK_V2_LITE, QWEN25_7B
from tests.support.roundtrip import fill_random, mha_families, mla_families, pages_to_rows, poison

# Starts Mooncake's master, which needs the mooncake package and Debian's libibverbs1
# (.ci/run installs them); the image build's run of the tier leaves this module out.
pytestmark = pytest.mark.l3_store

PAGE = 16
DEVICE_PAGES = 16       # 6 hold the originals, 10 are load targets
DATA_PAGES = 6
TRIPS = 2
LAYOUT_FLAGS = {
    "page_first": ("--hicache-mem-layout", "page_first"),
    "page_first_direct": ("--hicache-mem-layout", "page_first_direct", "--hicache-io-backend", "direct"),
    "layer_first": ("--hicache-mem-layout", "layer_first"),
}


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    l3.require_mooncake()  # skipped, and said so, without libibverbs1
    master = l3.MooncakeMaster(tmp_path_factory.mktemp("mooncake") / "master.log")
    with master.running():
        yield master


@pytest.fixture
def controller_env(host_modules, monkeypatch):
    """The controller on CPU (as in test_controller.py); the published config is reset after."""
    from sglang.srt.runtime_context import reset_context

    ctl.run_on_cpu(monkeypatch)
    yield host_modules
    reset_context()


# (host layout, kvcached layout) pairs the series serves. kvcached's default contiguous
# layout gives strided views; its per-layer layout gives dense MHA/MLA views (SGLang's
# own copy paths). page_first_direct is refused over strided views at startup
# (test_page_first_direct_over_strided_views_is_refused).
SERVED = [("page_first", "kvcached-contiguous"), ("page_first_direct", "kvcached-per-layer")]
FILE_SERVED = SERVED + [("layer_first", "kvcached-contiguous")]


def device_pool(kind, layout):
    size = DEVICE_PAGES * PAGE
    if kind == "MLA":
        s = DEEPSEEK_V2_LITE
        pool = l3.sglang_mla_pool(mla_pool(layout, size=size, page_size=PAGE, layers=s.layers,
                                           kv_lora_rank=s.kv_lora_rank, qk_rope_head_dim=s.qk_rope_head_dim))
    else:
        s = QWEN25_7B
        pool = mha_pool(layout, size=size, page_size=PAGE, layers=s.layers, heads=s.kv_heads, head_dim=s.head_dim)
    pool.register_layer_transfer_counter = lambda counter: None
    return pool


def is_strided(pool):
    views = pool.kv_buffer if hasattr(pool, "kv_buffer") else [*pool.k_buffer, *pool.v_buffer]
    return any(not view.is_contiguous() for view in views)


def l3_trips(kind, pool_layout, backend, layout, extra_config=None):
    """Publish the flags, build the stack with its storage backend, run the trips, detach.
    Returns what was built: the host pool, the backend, the controller's page I/O.

    The prefetch threshold is one page: the radix cache only fetches hits of at least
    that many tokens, and a trip moves 1-3 pages."""
    extra_config = {**(extra_config or {}), "prefetch_threshold": PAGE}
    ctl.publish_server_args("--hicache-storage-backend", backend, "--hicache-storage-backend-extra-config",
                            json.dumps(extra_config), *LAYOUT_FLAGS[layout])
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    kv = device_pool(kind, pool_layout)
    pages = list(range(1, DEVICE_PAGES + 1))  # page 0 holds SGLang's padding token
    params = ctl.cache_init_params(kv, PageAllocator(kv, pages[DATA_PAGES:], PAGE, "cpu", rng))
    with l3.single_rank():
        group, controller = ctl.build_stack(params, kv, use_mla=kind == "MLA", full_layers=range(kv.layer_num),
                                            **l3.storage_options())
    try:
        assert controller.enable_storage
        host = group.anchor_entry.host_pool
        # The generic page path (file backend) stages pages in torch.zeros(pin_memory=
        # host.pin_memory); pinning needs a CUDA driver, so plain host memory here.
        host.pin_memory = False
        families = (mla_families if kind == "MLA" else mha_families)(kv, host)
        fill_random(families, pages_to_rows(pages, PAGE), generator)
        poison(host.kv_buffer, generator)
        l3.StorageRoundTrip(controller, group, families, [], page_size=PAGE, data_pages=pages[:DATA_PAGES],
                            scratch_pages=pages[DATA_PAGES:], device="cpu").run(TRIPS)
        return SimpleNamespace(host=host, strided=is_strided(kv), backend=controller.storage_backend,
                               page_get=controller.page_get_func.__name__,
                               page_set=controller.page_set_func.__name__)
    finally:
        l3.detach_storage(controller)


@pytest.mark.parametrize("layout,pool_layout", SERVED)
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_mooncake_round_trip(controller_env, mooncake_master, kind, layout, pool_layout):
    built = l3_trips(kind, pool_layout, "mooncake", layout,
                     mooncake_master.extra_config(f"{kind}-{layout}-{pool_layout}"))
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import (
        MooncakeHostTensorAllocator, MooncakeStore)

    assert built.host.layout == layout and built.strided == (pool_layout == "kvcached-contiguous")
    assert isinstance(built.backend, MooncakeStore)
    assert built.backend.is_mla_backend == (kind == "MLA")
    # SGLang gives this backend host pools from Mooncake's allocator, registered with the
    # store, and moves pages zero-copy (batch_set_v1 / batch_get_v1 on host pointers).
    assert isinstance(built.host.allocator, MooncakeHostTensorAllocator)
    assert (built.page_set, built.page_get) == ("_page_set_zero_copy", "_page_get_zero_copy")


@pytest.mark.parametrize("layout,pool_layout", FILE_SERVED)
@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_file_backend_round_trip(controller_env, monkeypatch, tmp_path, kind, layout, pool_layout):
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    built = l3_trips(kind, pool_layout, "file", layout)
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    assert built.host.layout == layout and built.strided == (pool_layout == "kvcached-contiguous")
    assert isinstance(built.backend, HiCacheFile)
    assert (built.page_set, built.page_get) == ("_generic_page_set", "_generic_page_get")
    assert any(tmp_path.glob("*.bin")), "nothing reached the file store"


@pytest.mark.parametrize("kind", ["MHA", "MLA"])
def test_page_first_direct_over_strided_views_is_refused(controller_env, kind):
    """Refused when the stack is built, before the storage backend is created."""
    with pytest.raises(ValueError, match="page_first_direct"):
        l3_trips(kind, "kvcached-contiguous", "file", "page_first_direct")


@pytest.mark.parametrize("io_backend,layout", [("kernel", "page_first"), ("direct", "page_first_direct")])
def test_mooncake_takes_layer_first_as_a_page_first_layout(controller_env, io_backend, layout):
    """SGLang's own rewrite for this backend (hicache_hook.resolve_storage_layout_compatibility,
    which `--model-path dummy` flags skip, so it is run here): Mooncake reads whole pages
    zero-copy, so layer_first becomes page_first, or page_first_direct with direct io,
    which strided views do not serve (above)."""
    from sglang.srt.arg_groups.hicache_hook import resolve_storage_layout_compatibility
    from sglang.srt.runtime_context import get_memory, publish
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(["--model-path", "dummy", "--enable-hierarchical-cache",
                                       "--hicache-storage-backend", "mooncake", "--hicache-mem-layout", "layer_first",
                                       "--hicache-io-backend", io_backend])
    resolve_storage_layout_compatibility(server_args)
    publish(server_args, role="scheduler")
    assert get_memory().hicache_mem_layout == layout
