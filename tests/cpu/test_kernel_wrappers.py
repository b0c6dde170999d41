"""SGLang's kernel wrappers, called as the host pools call them, over the emulated kernels.

The wrappers the series changes (kernels/ops/kvcache/hicache.py: the staged write-back's
source stride; kernels/ops/mamba/transfer_mamba.py: the device slot stride) run unchanged;
only the compiled kernels below them are emulated (harness/emulation/__init__.py). Device
buffers are laid out as kvcached lays them out (a layer's rows or states strided by every
layer's), every byte random, host buffers poisoned: a stride a wrapper drops or defaults
wrongly copies other bytes, which the byte comparisons see. The last tests check the
emulation itself: it refuses what the compiled kernels refuse.
"""
from __future__ import annotations

import pytest
import torch

from harness.emulation.memory import KernelError
from tests.support.kvcached_views import mha_pool
from tests.support.roundtrip import RoundTrip, Rows, fill_random, pages_to_rows, poison

LAYERS, PAGE, ROW = 3, 4, 256  # ROW: bytes per token and layer (the JIT kernels need multiples of 128)
DEVICE_TOKENS, HOST_TOKENS = 8 * PAGE, 6 * PAGE


@pytest.fixture
def hicache(kernel_emulation):
    from sglang.kernels.ops.kvcache import hicache

    return hicache


@pytest.fixture
def mamba_ops(kernel_emulation):
    from sglang.kernels.ops.mamba import transfer_mamba

    return transfer_mamba


def random_bytes(*shape, seed=0):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def table(views):
    return torch.tensor([v.data_ptr() for v in views], dtype=torch.uint64)


def device_layers(kinds, strided, seed=0):
    """Per kind (K, V or KV), each layer's (tokens, ROW) byte view; strided = kvcached's
    contiguous layout, every layer and kind of a token in one row."""
    if strided:
        whole = random_bytes(DEVICE_TOKENS, LAYERS, kinds, ROW, seed=seed)
        return [[whole[:, l, k] for l in range(LAYERS)] for k in range(kinds)], LAYERS * kinds * ROW
    return [[random_bytes(DEVICE_TOKENS, ROW, seed=seed + 10 * k + l) for l in range(LAYERS)]
            for k in range(kinds)], None


def staged_backup(hicache, kinds, strided, *, pass_stride=True):
    layers, stride = device_layers(kinds, strided)
    hosts = [random_bytes(HOST_TOKENS, LAYERS, ROW, seed=99 + k).view(torch.bfloat16) for k in range(kinds)]
    before = [h.clone() for h in hosts]
    src, dst = pages_to_rows([5, 1, 6], PAGE), pages_to_rows([3, 0, 4], PAGE)  # three pages through two staging pages
    staging = [torch.empty(2 * PAGE, LAYERS, ROW // 2, dtype=torch.bfloat16) for _ in range(kinds)]
    extra = {"src_stride_bytes": stride} if pass_stride and stride else {}
    if kinds == 2:
        hicache.transfer_hicache_all_layer_staged_lf_pf(table(layers[0]), table(layers[1]), src, dst, *staging,
                                                        *hosts, page_size=PAGE, **extra)
    else:
        hicache.transfer_hicache_all_layer_mla_staged_lf_pf(table(layers[0]), src, dst, staging[0], hosts[0],
                                                            page_size=PAGE, **extra)
    for k in range(kinds):
        host = hosts[k].view(torch.uint8).view(HOST_TOKENS, LAYERS, ROW)
        for layer in range(LAYERS):
            assert torch.equal(host[dst, layer], layers[k][layer][src]), f"kind {k} layer {layer}"
        untouched = torch.ones(HOST_TOKENS, dtype=torch.bool)
        untouched[dst] = False
        assert torch.equal(host[untouched], before[k].view(torch.uint8).view(HOST_TOKENS, LAYERS, ROW)[untouched]), \
            "host rows no page targeted changed"


@pytest.mark.parametrize("kinds", [2, 1], ids=["MHA", "MLA"])
@pytest.mark.parametrize("strided", [True, False], ids=["strided", "dense"])
def test_staged_write_back_reads_the_device_stride(hicache, kinds, strided):
    staged_backup(hicache, kinds, strided)


@pytest.mark.parametrize("kinds", [2, 1], ids=["MHA", "MLA"])
def test_staged_write_back_without_the_stride_reads_dense_rows(hicache, kinds):
    """What a strided pool would get if the stride were dropped: the dense layout's bytes."""
    with pytest.raises(AssertionError, match="layer"):
        staged_backup(hicache, kinds, strided=True, pass_stride=False)


def mamba_device(strided, slots=6, item=96, seed=0):
    """A state's per-layer views: slot-major over all layers (kvcached) or one buffer per layer."""
    if strided:
        whole = random_bytes(slots, LAYERS, item, seed=seed)
        return [whole[:, l] for l in range(LAYERS)], LAYERS * item
    return [random_bytes(slots, item, seed=seed + l) for l in range(LAYERS)], None


@pytest.mark.parametrize("strided", [True, False], ids=["strided", "dense"])
def test_mamba_wrappers_step_device_slots_by_their_stride(mamba_ops, strided):
    item = 96
    layers, stride = mamba_device(strided, item=item)
    host = random_bytes(5, LAYERS * item, seed=7)
    host_before = host.clone()
    src, dst = torch.tensor([4, 1]), torch.tensor([0, 3])
    backup_stride = {"src_stride_bytes": stride} if stride else {}
    mamba_ops.transfer_kv_mamba_lf_pf(table(layers), host, src, dst, item, LAYERS * item, LAYERS, **backup_stride)
    for layer in range(LAYERS):
        assert torch.equal(host[dst, layer * item:(layer + 1) * item], layers[layer][src]), f"backup, layer {layer}"
    assert torch.equal(host[[1, 2, 4]], host_before[[1, 2, 4]])
    targets = torch.tensor([2, 5])
    originals = [l.clone() for l in layers]
    load_stride = {"dst_stride_bytes": stride} if stride else {}
    for layer in range(LAYERS):
        mamba_ops.transfer_kv_mamba_pf_lf(host, layers[layer], dst, targets, layer, item, LAYERS * item, **load_stride)
    for layer in range(LAYERS):
        assert torch.equal(layers[layer][targets], originals[layer][src]), f"load, layer {layer}"
        others = [s for s in range(6) if s not in (2, 5)]
        assert torch.equal(layers[layer][others], originals[layer][others]), f"load touched other slots, layer {layer}"


def test_an_explicit_unroll_is_the_one_built_and_launched(hicache, kernel_emulation):
    assert hicache.can_use_hicache_jit_kernel(element_size=1152, unroll=4)
    assert [args[1] for name, args in kernel_emulation.recorder.builds if name == "hicache"] == ["4"]
    rows = torch.zeros(64, 576, dtype=torch.bfloat16)
    ptrs = table([rows])
    index = torch.arange(8)
    calls = [
        lambda u: hicache.transfer_hicache_one_layer(rows, rows, index, rows.clone(), rows.clone(), index, unroll=u),
        lambda u: hicache.transfer_hicache_all_layer(ptrs, ptrs, index, ptrs, ptrs, index, unroll=u,
                                                     kv_cache_src_stride_bytes=1152, kv_cache_dst_stride_bytes=1152),
        lambda u: hicache.transfer_hicache_one_layer_mla(rows, index, rows.clone(), index, unroll=u),
        lambda u: hicache.transfer_hicache_all_layer_mla(ptrs, index, ptrs, index, unroll=u,
                                                         cache_src_stride_bytes=1152, cache_dst_stride_bytes=1152),
    ]
    for unroll in (4, 1):
        for call in calls:
            call(unroll)
    assert [launch.template[1] for launch in kernel_emulation.recorder.launches] == [4] * 4 + [1] * 4


def test_rows_the_jit_kernel_cannot_take_are_refused_by_the_gates(hicache, kernel_emulation):
    assert not hicache.can_use_hicache_jit_kernel(element_size=1152 + 64)   # not a multiple of 128
    assert not hicache.can_use_write_back_jit_kernel(element_size=1152 + 8)  # not a multiple of 16
    kernel_emulation.fail_builds("hicache", "hicache_staged")
    assert not hicache.can_use_hicache_jit_kernel(element_size=1152)         # the build fails
    assert not hicache.can_use_write_back_jit_kernel(element_size=1152)


# The emulation refuses what the compiled kernels refuse.

def test_emulated_mamba_kernel_refuses_what_transfer_mamba_cuh_refuses(mamba_ops):
    layers, stride = mamba_device(True, item=96)
    host = torch.zeros(5, LAYERS * 96, dtype=torch.uint8)
    idx = torch.tensor([1])
    with pytest.raises(KernelError, match="16-byte aligned"):
        mamba_ops.transfer_kv_mamba_lf_pf(table(layers), host, idx, idx, 40, LAYERS * 96, LAYERS)
    with pytest.raises(KernelError, match="indices dtype|dtype"):
        mamba_ops.transfer_kv_mamba_lf_pf(table(layers), host, idx.int(), idx.int(), 96, LAYERS * 96, LAYERS)


def test_emulated_hicache_kernel_refuses_mismatched_rows(hicache):
    rows = torch.zeros(16, 256, dtype=torch.bfloat16)  # 512-byte rows
    index = torch.arange(4)
    module = hicache._jit_hicache_module(element_size=1024, unroll=2, block_quota=2)  # built for 1024-byte rows
    with pytest.raises(KernelError, match="cache dimension mismatch"):
        module.launch_one(rows, rows, index, rows.clone(), rows.clone(), index)
    with pytest.raises(TypeError, match="Mismatched number of arguments"):
        module.launch_one(rows, rows, index, rows.clone(), rows.clone())
    with pytest.raises(KernelError, match="invalid configuration"):
        hicache.transfer_hicache_one_layer(rows, rows, index[:0], rows.clone(), rows.clone(), index[:0])


def test_emulated_copies_stay_inside_their_buffers(hicache):
    rows = torch.zeros(16, 128, dtype=torch.uint8)
    ptrs = table([rows])
    with pytest.raises(KernelError, match="illegal memory access"):
        hicache.transfer_hicache_all_layer_mla(ptrs, torch.tensor([16]), ptrs, torch.tensor([0]),
                                               cache_src_stride_bytes=128, cache_dst_stride_bytes=128)


def host_image(host, kind, layer):
    """Host rows of one layer as the layout documents them (MHATokenToKVPoolHost.init_kv_buffer)."""
    buffer = host.kv_buffer[kind]
    if host.layout == "layer_first":    # (layers, tokens, heads, dim)
        return buffer[layer]
    if host.layout == "page_first":     # (tokens, layers, heads, dim)
        return buffer[:, layer]
    pages, heads, page, _, dim = buffer.shape  # page_head: (pages, heads, page, layers, dim)
    return buffer[:, :, :, layer].permute(0, 2, 1, 3).reshape(pages * page, heads, dim)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_head"])
def test_sgl_kernel_copies_follow_each_host_layout(host_modules, layout):
    """Rows the JIT kernel cannot take (192 bytes) go through sglang-kernel's warp kernels:
    the emulated offset functions must put every byte where the host layout says."""
    pool = mha_pool("native", size=8 * PAGE, page_size=PAGE, layers=LAYERS, heads=2, head_dim=48)
    host = host_modules.mha.MHATokenToKVPoolHost(pool, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu")
    assert not host.can_use_jit
    generator = torch.Generator().manual_seed(1)
    families = [Rows(name, views, lambda l, kind=kind: host_image(host, kind, l))
                for kind, (name, views) in enumerate((("K", pool.k_buffer), ("V", pool.v_buffer)))]
    device_pages = range(pool.k_buffer[0].shape[0] // PAGE)  # every device row, so no stray write goes unseen
    fill_random(families, pages_to_rows(device_pages, PAGE), generator)
    poison(host.kv_buffer, generator)
    RoundTrip(families, device_pages, range(host.size // PAGE), PAGE, LAYERS,
              backup=lambda h, d: host.backup_from_device_all_layer(pool, h, d, "kernel"),
              load=lambda h, d, layer: host.load_to_device_per_layer(pool, h, d, layer, "kernel"),
              device="cpu").run(4)
