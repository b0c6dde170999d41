"""SGLang's kernel wrappers, called as the host pools call them, over the emulated kernels.

The wrappers the series changes (kernels/ops/kvcache/hicache.py: the staged
write-back's source stride and the unroll choice; kernels/ops/mamba/transfer_mamba.py:
the device slot stride) run unchanged; only the compiled kernels below them are
emulated (tests/support/emulators.py). Device buffers are laid out as kvcached lays
them out (a layer's rows strided by every layer's row, or a layer's states strided by
every layer's state), every byte random, host buffers poisoned: a stride a wrapper
drops or defaults wrongly copies other bytes, which the byte comparisons see. The last
tests check the emulation itself: it refuses what the compiled kernels refuse.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.emulated_memory import KernelError

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


def page_rows(pages):
    return torch.tensor([p * PAGE + t for p in pages for t in range(PAGE)], dtype=torch.int64)


def staged_backup(hicache, kinds, strided, *, pass_stride=True):
    layers, stride = device_layers(kinds, strided)
    hosts = [random_bytes(HOST_TOKENS, LAYERS, ROW, seed=99 + k).view(torch.bfloat16) for k in range(kinds)]
    before = [h.clone() for h in hosts]
    src, dst = page_rows([5, 1, 6]), page_rows([3, 0, 4])  # three pages through two staging pages
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
        lambda u: hicache.transfer_hicache_all_layer_mla(ptrs, index, ptrs, index, unroll=u, cache_src_stride_bytes=1152,
                                                         cache_dst_stride_bytes=1152),
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
    from tests.support.kvcached_views import mha_pool

    pool = mha_pool("native", size=8 * PAGE, page_size=PAGE, layers=LAYERS, heads=2, head_dim=48)
    host = host_modules.mha.MHATokenToKVPoolHost(pool, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu")
    assert not host.can_use_jit
    generator = torch.Generator().manual_seed(1)
    for view in (*pool.k_buffer, *pool.v_buffer):
        view.view(torch.uint8).copy_(torch.randint(0, 256, view.view(torch.uint8).shape, generator=generator,
                                                   dtype=torch.uint8))
    device_rows, host_rows, load_rows = page_rows([2, 5]), page_rows([1, 3]), page_rows([6, 7])
    originals = [[v.clone() for v in kind] for kind in (pool.k_buffer, pool.v_buffer)]
    host.backup_from_device_all_layer(pool, host_rows, device_rows, "kernel")
    for kind, views in enumerate((pool.k_buffer, pool.v_buffer)):
        for layer, view in enumerate(views):
            assert torch.equal(host_image(host, kind, layer)[host_rows].view(torch.uint8),
                               view[device_rows].view(torch.uint8)), f"backup: kind {kind} layer {layer}"
    for layer in range(LAYERS):
        host.load_to_device_per_layer(pool, host_rows, load_rows, layer, "kernel")
    for kind, views in enumerate((pool.k_buffer, pool.v_buffer)):
        for layer, view in enumerate(views):
            assert torch.equal(view[load_rows].view(torch.uint8), originals[kind][layer][device_rows].view(torch.uint8))
            others = torch.ones(view.shape[0], dtype=torch.bool)
            others[load_rows] = False
            assert torch.equal(view[others].view(torch.uint8), originals[kind][layer][others].view(torch.uint8))


def test_staged_write_back_launches_stop_at_the_staging_size_and_at_host_registration_pieces(hicache):
    # 10 host pages of 4 tokens (128 bytes a page), "pinned" in pieces of 3 pages: host
    # pages 1-5 in a row cross a piece before page 3, so a launch ends there too.
    buffer = torch.zeros(2, 40, 8)
    page_bytes = 4 * 8 * 4
    total = buffer.numel() * 4
    pieces = [(buffer.data_ptr() + offset, min(3 * page_bytes, total - offset))
              for offset in range(0, total, 3 * page_bytes)]
    host_rows = torch.arange(4, 24)
    plan = hicache._staged_write_back_calls
    assert plan(host_rows, [buffer[0]], pieces, 5, 4, 64) == [(0, 2), (2, 3)]
    assert plan(host_rows, [buffer[0]], pieces, 5, 4, 2) == [(0, 2), (2, 2), (4, 1)]
    assert plan(host_rows, [buffer[0]], pieces, 5, 4, 1) == [(i, 1) for i in range(5)]
    # V's pages sit 10 pages further: its pieces cut host pages 1-5 before page 2 and page 5
    assert plan(host_rows, [buffer[0], buffer[1]], pieces, 5, 4, 64) == [(0, 1), (1, 1), (2, 2), (4, 1)]
    # two pages, and a pool in two pieces, are cut as well
    assert plan(host_rows[4:12], [buffer[0]], pieces, 2, 4, 64) == [(0, 1), (1, 1)]   # pages 2, 3
    two_pieces = [(buffer.data_ptr(), 3 * page_bytes), (buffer.data_ptr() + 3 * page_bytes, total - 3 * page_bytes)]
    assert plan(host_rows, [buffer[0]], two_pieces, 5, 4, 64) == [(0, 2), (2, 3)]
    # one piece, or pages that do not follow each other: nothing to cut
    assert plan(host_rows, [buffer[0]], pieces[:1], 5, 4, 64) == [(0, 5)]
    scattered = torch.cat([torch.arange(p * 4, p * 4 + 4) for p in (1, 3, 5)])
    assert plan(scattered, [buffer[0]], pieces, 3, 4, 64) == [(0, 3)]
    with pytest.raises(ValueError, match="less than one page of 4 tokens"):
        plan(host_rows, [buffer[0]], pieces, 5, 4, 0)


def test_staged_write_back_alternates_staging_halves_only_when_it_needs_more_than_one_launch(hicache):
    def plan(pages):
        return lambda capacity: [(b, min(capacity, pages - b)) for b in range(0, pages, capacity)]

    launches = hicache._staged_write_back_launches
    # 10 pages through a buffer of 4 or 8: halves of 2 or 4 pages, taking turns
    assert launches(plan(10), 4, True) == [(0, 2, 0), (2, 2, 1), (4, 2, 0), (6, 2, 1), (8, 2, 0)]
    assert launches(plan(10), 8, True) == [(0, 4, 0), (4, 4, 1), (8, 2, 0)]
    # one launch, no overlap possible (a CPU staging buffer), or a buffer of one page: the whole buffer in turn
    assert launches(plan(10), 16, True) == [(0, 10, None)]
    assert launches(plan(10), 4, False) == [(0, 4, None), (4, 4, None), (8, 2, None)]
    assert launches(plan(3), 1, True) == [(0, 1, None), (1, 1, None), (2, 1, None)]
    assert launches(plan(0), 4, True) == []


def test_staged_write_back_overlaps_on_cuda_devices_only(hicache, monkeypatch):
    from types import SimpleNamespace

    assert hicache._can_overlap_write_back(SimpleNamespace(is_cuda=True)) is True
    assert hicache._can_overlap_write_back(torch.empty(1)) is False
    monkeypatch.setattr(hicache, "_is_hip", True)  # measured on NVIDIA GPUs only
    assert hicache._can_overlap_write_back(SimpleNamespace(is_cuda=True)) is False


def test_staged_write_back_keeps_two_streams_per_device_and_priority(hicache, monkeypatch):
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority: made.append((device, priority)) or len(made))
    hicache._write_back_streams.cache_clear()
    try:
        first = hicache._write_back_streams("cuda:0", 0)
        assert hicache._write_back_streams("cuda:0", 0) is first and made == [("cuda:0", 0)] * 2
        assert hicache._write_back_streams("cuda:0", -1) != first and hicache._write_back_streams("cuda:1", 0) != first
        assert made[2:] == [("cuda:0", -1)] * 2 + [("cuda:1", 0)] * 2
    finally:
        hicache._write_back_streams.cache_clear()


class RecordedStream:
    """A CUDA stream's waits, recorded: the ordering the staged write-back asks for."""

    def __init__(self, name, log, priority=0):
        self.name, self.log, self.priority = name, log, priority

    def wait_stream(self, other):
        self.log.append(("wait", self.name, other.name))


@pytest.fixture
def recorded_streams(hicache, monkeypatch):
    """The write-back's streams as records, and its overlap taken on CPU tensors: the
    runner then issues each launch inside `torch.cuda.stream(...)` of a recorded
    stream. Returns the log, the stack of streams launches are issued on, and the
    arguments the runner asked for its streams with."""
    from contextlib import contextmanager

    log, active, asked = [], ["current"], []
    current = RecordedStream("current", log, priority=-1)
    sides = (RecordedStream("side0", log), RecordedStream("side1", log))

    @contextmanager
    def on(stream):
        active.append(stream.name)
        yield
        active.pop()

    def current_stream(device=None):
        asked.append(("current", device))
        return current

    def write_back_streams(device, priority):
        asked.append(("sides", device, priority))
        return sides

    monkeypatch.setattr(hicache, "_can_overlap_write_back", lambda staging: True)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(hicache, "_write_back_streams", write_back_streams)
    return log, active, asked


def five_pages(capacity):
    return [(b, min(capacity, 5 - b)) for b in range(0, 5, capacity)]


def test_staged_write_back_runs_each_half_on_its_own_stream_between_waits_on_the_current_one(
        hicache, recorded_streams):
    log, active, asked = recorded_streams
    staging = torch.arange(4 * PAGE)  # 4 pages: halves of 2 pages, at tokens 0 and 2 * PAGE

    def launch(first, pages, views):
        (view,) = views
        log.append(("launch", active[-1], first, pages, view[0].item(), len(view)))

    hicache._run_staged_write_back(five_pages, [staging], PAGE, launch)
    assert log == [("wait", "side0", "current"), ("wait", "side1", "current"),
                   ("launch", "side0", 0, 2, 0, 2 * PAGE), ("launch", "side1", 2, 2, 2 * PAGE, 2 * PAGE),
                   ("launch", "side0", 4, 1, 0, PAGE),
                   ("wait", "current", "side0"), ("wait", "current", "side1")]
    # the staging buffer's device, and side streams at the current stream's priority
    assert asked == [("current", staging.device), ("sides", staging.device, -1)]


def test_staged_write_back_joins_its_streams_when_a_launch_raises(hicache, recorded_streams):
    log, active, _ = recorded_streams

    def launch(first, pages, views):
        if first:
            raise RuntimeError("copy failed")
        log.append(("launch", active[-1], first))

    with pytest.raises(RuntimeError, match="copy failed"):
        hicache._run_staged_write_back(five_pages, [torch.arange(4 * PAGE)], PAGE, launch)
    assert log[-3:] == [("launch", "side0", 0), ("wait", "current", "side0"), ("wait", "current", "side1")]


def test_staged_write_back_of_no_pages_launches_nothing(hicache, recorded_streams):
    log, _, asked = recorded_streams
    hicache._run_staged_write_back(lambda capacity: [], [torch.arange(4 * PAGE)], PAGE,
                                   lambda *args: log.append("launch"))
    assert log == [] and asked == []


@pytest.mark.parametrize("kinds", [2, 1], ids=["MHA", "MLA"])
def test_staged_write_back_in_staging_halves_copies_every_page(hicache, recorded_streams, kinds):
    """Three pages through two staging pages: in halves, three launches of one page,
    each slicing its own device and host pages; the bytes are checked as above."""
    log, _, _ = recorded_streams
    staged_backup(hicache, kinds, strided=True)
    assert [entry[:2] for entry in log] == [("wait", "side0"), ("wait", "side1"),
                                            ("wait", "current"), ("wait", "current")]
