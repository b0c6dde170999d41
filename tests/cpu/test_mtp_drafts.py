"""MTP draft layers packed into the target's host pool, over strided device views.

For EAGLE with NextN draft layers SGLang packs each draft's one-layer device pool into
the target's host pool (``mtp_draft_device_pools``): host layers are the target's, then
one per draft. Backups copy every host layer in one call; loads run per layer, the
drafts' with ``is_draft=True`` against their own device pool. The target's and the
drafts' device views need not share a stride (kvcached allocates each pool on its own,
and a one-layer pool in kvcached's contiguous layout interleaves only its K and V),
so every pool's layers are copied with their own stride and pointer table.

On SGLang 0.5.20 without the series these trips fail for every strided case.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.kvcached_views import mha_pool, mla_pool
from tests.support.roundtrip import RoundTrip, Rows, fill_random, host_layer_rows, pages_to_rows, poison

LAYERS, HEADS, HEAD_DIM = 3, 2, 64
KV_LORA_RANK, ROPE_DIM = 96, 32
DEVICE_PAGES = 10
TRIPS = 6
# page_first_direct is refused for strided views (tests/cpu/test_refusals.py)
HOST_CASES = [("layer_first", "kernel"), ("page_first", "kernel"), ("layer_first", "direct")]
# (target's kvcached layout, drafts' layout): strided with strided, and each beside a dense pool
POOL_LAYOUTS = [("kvcached-contiguous", "kvcached-contiguous"), ("kvcached-contiguous", "native"),
                ("native", "kvcached-contiguous"), ("kvcached-per-layer", "kvcached-contiguous"),
                ("native", "native")]


def cases(test):
    for mark in (pytest.mark.parametrize("target_layout,draft_layout", POOL_LAYOUTS),
                 pytest.mark.parametrize("host_layout,io_backend", HOST_CASES),
                 pytest.mark.parametrize("drafts,page_size", [(1, 1), (2, 16)])):
        test = mark(test)
    return test


def run(kind, target, drafts, host, page_size, io_backend):
    rows = families(kind, [target, *drafts], host)
    generator = torch.Generator().manual_seed(11)
    used_pages = list(range(1, DEVICE_PAGES))
    fill_random(rows, pages_to_rows(used_pages, page_size), generator)
    for buffer in (host.kv_buffer if isinstance(host.kv_buffer, (tuple, list)) else (host.kv_buffer,)):
        poison(buffer, generator)

    def load(h, d, layer):
        if layer < target.layer_num:
            host.load_to_device_per_layer(target, h, d, layer, io_backend)
        else:
            draft = drafts[layer - target.layer_num]
            host.load_to_device_per_layer(draft, h, d, layer, io_backend, is_draft=True)

    RoundTrip(rows, used_pages, range(1, host.size // page_size), page_size, target.layer_num + len(drafts),
              backup=lambda h, d: host.backup_from_device_all_layer(target, h, d, io_backend),
              load=load, seed=7, device="cpu").run(TRIPS)


def make_pool(kind, layout, size, page_size, layers):
    if kind == "mha":
        return mha_pool(layout, size=size, page_size=page_size, layers=layers, heads=HEADS, head_dim=HEAD_DIM)
    return mla_pool(layout, size=size, page_size=page_size, layers=layers, kv_lora_rank=KV_LORA_RANK,
                    qk_rope_head_dim=ROPE_DIM)


def host_class(host_modules, kind):
    return host_modules.mha.MHATokenToKVPoolHost if kind == "mha" else host_modules.mla.MLATokenToKVPoolHost


def packed_host(host_modules, kind, target_layout, draft_layout, drafts, page_size, host_layout):
    """A target pool, its one-layer draft pools, and the host pool that packs them."""
    size = DEVICE_PAGES * page_size
    target = make_pool(kind, target_layout, size, page_size, LAYERS)
    draft_pools = [make_pool(kind, draft_layout, size, page_size, 1) for _ in range(drafts)]
    host = host_class(host_modules, kind)(target, 2.0, 0, page_size, host_layout, pin_memory=False, device="cpu",
                                          mtp_draft_device_pools=draft_pools)
    return target, draft_pools, host


def families(kind, pools, host):
    """Per buffer kind, every pool's layer views in host-layer order (the target's, then each draft's)."""
    if kind == "mha":
        return [Rows("K", [v for p in pools for v in p.k_buffer], host_layer_rows(host, host.k_data_refs, 0)),
                Rows("V", [v for p in pools for v in p.v_buffer], host_layer_rows(host, host.v_data_refs, 1))]
    return [Rows("KV", [v for p in pools for v in p.kv_buffer], host_layer_rows(host, host.data_refs))]


@cases
def test_mha_packed_drafts(host_modules, target_layout, draft_layout, host_layout, io_backend, drafts,
                           page_size):
    target, draft_pools, host = packed_host(host_modules, "mha", target_layout, draft_layout, drafts, page_size,
                                            host_layout)
    assert host.layer_num == LAYERS + drafts
    run("mha", target, draft_pools, host, page_size, io_backend)


@cases
def test_mla_packed_drafts(host_modules, target_layout, draft_layout, host_layout, io_backend, drafts,
                           page_size):
    """The MLA host pool serves packed drafts whose rows share the target's stride, and
    refuses the others at startup (no MLA model with a draft runs over kvcached)."""
    size = DEVICE_PAGES * page_size
    strides = {view.stride(0) for layout, layers in ((target_layout, LAYERS), (draft_layout, 1))
               for view in make_pool("mla", layout, size, page_size, layers).kv_buffer}
    if len(strides) > 1:
        with pytest.raises(ValueError, match="MLA device pools' rows are strided by different amounts"):
            packed_host(host_modules, "mla", target_layout, draft_layout, drafts, page_size, host_layout)
        return
    target, draft_pools, host = packed_host(host_modules, "mla", target_layout, draft_layout, drafts, page_size,
                                            host_layout)
    run("mla", target, draft_pools, host, page_size, io_backend)


def test_page_first_with_drafts_backs_up_with_device_host_indices(host_modules):
    """The staged write-back gathers all host layers of a page at once and so takes one
    stride; with strided drafts the pool backs up through the all-layer kernel, whose
    host indices the controller must place on the device (can_use_write_back_jit off).
    MHA only: the MLA host pool refuses drafts strided unlike the target (above)."""
    make = lambda layers: make_pool("mha", "kvcached-contiguous", 4 * 16, 16, layers)
    cls = host_modules.mha.MHATokenToKVPoolHost
    alone = cls(make(LAYERS), 2.0, 0, 16, "page_first", pin_memory=False, device="cpu")
    packed = cls(make(LAYERS), 2.0, 0, 16, "page_first", pin_memory=False, device="cpu",
                 mtp_draft_device_pools=[make(1)])
    assert alone.can_use_write_back_jit and not packed.can_use_write_back_jit
    assert [run[:2] for run in packed._device_row_runs] == [(0, LAYERS), (LAYERS, LAYERS + 1)]
    # The packed pool keeps no staging buffer (device memory) for the path it gave up.
    assert alone.staging_k_buffer is not None and alone.staging_v_buffer is not None
    assert packed.staging_k_buffer is None and packed.staging_v_buffer is None
    # One page backed up: the single pool through the staged write-back, the packed one
    # run by run (target, then draft) through the all-layer kernel.
    launched = host_modules.emulation.recorder.launches
    for host, kernels in ((alone, ["launch_all_lf_pf_staged"]), (packed, ["launch_all", "launch_all"])):
        del launched[:]
        page = torch.arange(16, 32)
        host.backup_from_device_all_layer(host.device_pool, page, page, "kernel")
        assert [launch.export for launch in launched] == kernels


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_page_first_without_the_staged_write_back(host_modules, monkeypatch, kind):
    """Where the staged write-back kernel cannot be built, strided page_first backups run
    through the all-layer JIT kernel into the page_first host rows instead of refusing."""
    module = host_modules.mha if kind == "mha" else host_modules.mla
    monkeypatch.setattr(module, "can_use_write_back_jit_kernel", lambda **kw: False)
    page = 16
    target = make_pool(kind, "kvcached-contiguous", DEVICE_PAGES * page, page, LAYERS)
    host = host_class(host_modules, kind)(target, 2.0, 0, page, "page_first", pin_memory=False, device="cpu")
    assert not host.can_use_write_back_jit
    run(kind, target, [], host, page, "kernel")


def test_npu_pools_with_drafts_are_not_asked_for_pointer_tables(host_modules, monkeypatch):
    """Ascend's device pools (NPUMHATokenToKVPool) keep K and V each as one multi-layer
    tensor and publish no pointer tables; their host pool copies through the NPU kernels,
    which take the buffers. The strided-view check beside the NPU one must not make a
    host pool with packed drafts read the tables there."""
    monkeypatch.setattr(host_modules.mha, "_is_npu", True)
    page = 16

    def npu_pool(layers):
        pool = mha_pool("native", size=4 * page, page_size=page, layers=layers, heads=HEADS, head_dim=HEAD_DIM)
        del pool.k_data_ptrs, pool.v_data_ptrs
        pool.k_buffer, pool.v_buffer = (torch.zeros(layers, 5, page, HEADS, HEAD_DIM, dtype=pool.dtype)
                                        for _ in range(2))
        return pool

    target, draft = npu_pool(LAYERS), npu_pool(1)
    host = host_modules.mha.MHATokenToKVPoolHost(target, 2.0, 0, page, "layer_first", pin_memory=False,
                                                 device="cpu", mtp_draft_device_pools=[draft])
    assert host.device_rows_packed
    assert host.packed_device_k_data_ptrs is None and host.packed_device_v_data_ptrs is None
    assert len(host.packed_device_k_buffers) == len(host.packed_device_v_buffers) == LAYERS + 1
