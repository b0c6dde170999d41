"""MambaPoolHost over kvcached-shaped Mamba pools: geometry, sizing, byte-exact copies.

Shapes are a GDN layer scaled down (conv (dim, K-1) bf16, SSM (HV, V, K) fp32) so the
CPU emulators stay fast; cells are padded to a divisor of the (scaled) page exactly as
kvcached pads them. On SGLang 0.5.20 without the series, the per-layer layout fails at
construction (layer-0 views) and the contiguous layout fails the content checks.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.support.kvcached_views import LAYOUTS, mamba_pool
from tests.support.roundtrip import RoundTrip, fill_random, mamba_families, poison

LAYERS, SLOTS = 3, 10
CONV_SHAPES = [(96, 3)]          # 576 B per slot and layer
TEMPORAL_SHAPE = (2, 16, 16)     # 2048 B
PAGE_BYTES = 64 << 10


def build(host_modules, layout, host_layout="page_first", layers=LAYERS):
    pool = mamba_pool(layout, slots=SLOTS, layers=layers, conv_shapes=CONV_SHAPES,
                      temporal_shape=TEMPORAL_SHAPE, page_bytes=PAGE_BYTES)
    host = host_modules.mamba.MambaPoolHost(pool, 2.0, 0, pin_memory=False, device="cpu", layout=host_layout)
    return pool, host


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_pool_sees_the_model_geometry(host_modules, layout):
    _, host = build(host_modules, layout)
    _, native = build(host_modules, "native")
    assert tuple(host.temporal_state_shape) == TEMPORAL_SHAPE
    assert [tuple(s) for s in host.conv_state_shapes] == CONV_SHAPES
    expected = LAYERS * (math.prod(CONV_SHAPES[0]) * 2 + math.prod(TEMPORAL_SHAPE) * 4)
    assert host.size_per_token == native.size_per_token == expected
    assert host.size == native.size


def test_a_pool_of_one_mamba_layer(host_modules):
    """A pipeline stage may hold a single linear-attention layer: its host pool reads the
    state geometry from that layer alone and copies it byte for byte."""
    pool, host = build(host_modules, "kvcached-contiguous", layers=1)
    assert (tuple(host.temporal_state_shape), [tuple(s) for s in host.conv_state_shapes]) == (
        TEMPORAL_SHAPE, CONV_SHAPES)
    assert (host.temporal_dtype, host.conv_dtype) == (torch.float32, torch.bfloat16)
    round_trips(pool, host, "kernel", layers=1, seed=3, trips=6)


def round_trips(pool, host, io_backend, layers, seed, trips):
    """Random slots backed up and loaded back layer by layer, every other byte poisoned."""
    generator = torch.Generator().manual_seed(seed)
    fams = mamba_families(pool, host)
    used = list(range(1, SLOTS + 1))
    fill_random(fams, torch.tensor(used), generator)
    for buffer in (host.temporal_buffer, *host.conv_buffer):
        poison(buffer, generator)
    RoundTrip(fams, used, range(host.size), 1, layers,
              backup=lambda h, d: host.backup_from_device_all_layer(pool, h, d, io_backend),
              load=lambda h, d, l: host.load_to_device_per_layer(pool, h, d, l, io_backend),
              seed=seed + 2, max_pages=3, device="cpu").run(trips)


# sglang-kernel's page_first_direct copy takes stride(0) bytes per slot: it serves dense
# slots only, and strided state views with it are refused (test_refusals.py).
ROUND_TRIPS = [(layout, "page_first", "kernel") for layout in LAYOUTS] + [
    ("native", "page_first_direct", "direct")]


@pytest.mark.parametrize("layout,host_layout,io_backend", ROUND_TRIPS)
def test_round_trips(host_modules, layout, host_layout, io_backend):
    pool, host = build(host_modules, layout, host_layout)
    round_trips(pool, host, io_backend, layers=LAYERS, seed=2, trips=25)


def test_refuses_slot_stride_the_kernels_cannot_step(host_modules):
    # A 3-byte-aligned cell can't happen with kvcached's divisor-of-page padding, but a
    # stride that is not a multiple of 16 must be refused, not served with misaligned loads.
    layers, slots = 1, 4  # slots 40 bytes apart
    flat = torch.zeros(layers * (slots + 1) * 40, dtype=torch.int8)
    from sglang.srt.mem_cache.memory_pool import MambaPool
    from types import SimpleNamespace
    view = lambda shape, dtype, off: torch.as_strided(flat.view(dtype), (layers, slots + 1, *shape),
                                                       (40 // dtype.itemsize, layers * 40 // dtype.itemsize,
                                                        *([1] if len(shape) == 1 else [shape[1], 1])), off)
    cache = MambaPool.State(conv=[view((16,), torch.int8, 0)], temporal=view((4,), torch.float32, 4))
    pool = SimpleNamespace(mamba_cache=cache, num_mamba_layers=layers, size=slots, device="cpu")
    pool.mamba2_layer_cache = cache.at_layer_idx
    with pytest.raises(ValueError, match="slots 16-byte aligned"):
        host_modules.mamba.MambaPoolHost(pool, 2.0, 0, pin_memory=False, device="cpu", layout="page_first")
