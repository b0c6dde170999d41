"""Unit tests for MambaPoolHost over per-layer device state views.

MambaPoolHost reads each layer's device states through ``mamba_cache.at_layer_idx``,
the accessor every Mamba pool implements, and passes each state's slot stride to the
transfer kernels. SGLang's own pools stack the layers (dense slots); others allocate
layers apart or keep each slot's states in one padded cell (strided slots). A host
pool built without ``__init__``, as the JIT transfer kernel tests build one, keeps
reading the stacked ``mamba_cache`` tensors. The kernels are replaced by torch
references that resolve their pointer tables and check the strides they are given.
"""

import threading
import unittest
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.srt.mem_cache.pool_host import mamba as mamba_pool_host
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

NUM_LAYERS, SLOTS = 3, 8
TEMPORAL_SHAPE, CONV_SHAPE = (4, 16), (2, 24)  # 128 and 96 bytes of fp16


@dataclass
class _LayerState:
    temporal: torch.Tensor
    conv: list


class _PerLayerCache:
    """A Mamba cache whose layers are only reachable through at_layer_idx."""

    def __init__(self, temporal, conv):
        self._temporal, self._conv = temporal, conv

    def at_layer_idx(self, layer):
        return _LayerState(self._temporal[layer], [conv[layer] for conv in self._conv])


def _padded_cells(dtype=torch.float16):
    """One padded cell per slot holding every layer's states: strided slot views."""
    temporal_bytes = NUM_LAYERS * 128
    cell = torch.randn(SLOTS, temporal_bytes // 2 + NUM_LAYERS * 48 + 64).to(dtype)  # 64 elements of padding
    temporal = [
        cell[:, layer * 64 : (layer + 1) * 64].view(SLOTS, *TEMPORAL_SHAPE)
        for layer in range(NUM_LAYERS)
    ]
    conv_start = temporal_bytes // 2
    conv = [
        cell[:, conv_start + layer * 48 : conv_start + (layer + 1) * 48].view(SLOTS, *CONV_SHAPE)
        for layer in range(NUM_LAYERS)
    ]
    return temporal, [conv]


def _device_pool(mamba_cache):
    return SimpleNamespace(
        mamba_cache=mamba_cache, size=SLOTS - 1, device="cpu", num_mamba_layers=NUM_LAYERS
    )


class _ReferenceKernels:
    def __init__(self, views):
        self.views = {view.data_ptr(): view for view in views}
        self.strides = []

    def backup(self, *, src_ptrs, dst, src_indices, dst_indices, num_layers, src_stride_bytes, **_):
        for layer, ptr in enumerate(src_ptrs.tolist()):
            src = self.views[ptr]
            assert src.stride(0) * src.element_size() == src_stride_bytes
            self.strides.append(src_stride_bytes)
            dst[dst_indices, layer, 0] = src[src_indices]

    def load(self, *, src, dst, src_indices, dst_indices, layer_id, dst_stride_bytes, **_):
        assert dst.stride(0) * dst.element_size() == dst_stride_bytes
        self.strides.append(dst_stride_bytes)
        dst[dst_indices] = src[src_indices, layer_id, 0]


class TestMambaHostPoolDeviceViews(CustomTestCase):
    def _host(self, device_pool, layout="page_first"):
        with mock.patch.object(mamba_pool_host, "host_memory_budget_bytes", return_value=1 << 40):
            return mamba_pool_host.MambaPoolHost(
                device_pool, 2.0, 0, pin_memory=False, device="cpu", layout=layout
            )

    def _round_trip(self, device_pool, host, views):
        kernels = _ReferenceKernels(views)
        device_slots = torch.tensor([1, 5, 6])
        host_slots = host.alloc(3)
        temporal, conv = host._device_state_layers(device_pool)
        expected = [layer[device_slots].clone() for layer in (*temporal, *conv[0])]
        with (
            mock.patch.object(mamba_pool_host, "transfer_kv_mamba_lf_pf", side_effect=kernels.backup, create=True),
            mock.patch.object(mamba_pool_host, "transfer_kv_mamba_pf_lf", side_effect=kernels.load, create=True),
        ):
            host.backup_from_device_all_layer(device_pool, host_slots, device_slots, "kernel")
            for layer in (*temporal, *conv[0]):
                layer.zero_()
            for layer_id in range(NUM_LAYERS):
                host.load_to_device_per_layer(device_pool, host_slots, device_slots, layer_id, "kernel")
        for want, layer in zip(expected, (*temporal, *conv[0]), strict=True):
            self.assertTrue(torch.equal(layer[device_slots], want))
        return kernels

    def test_strided_slot_views_round_trip_with_their_stride(self):
        temporal, conv = _padded_cells()
        device_pool = _device_pool(_PerLayerCache(temporal, conv))
        host = self._host(device_pool)
        # shapes come from the per-layer views, as for a stacked pool of the same model
        self.assertEqual(tuple(host.temporal_state_shape), TEMPORAL_SHAPE)
        self.assertEqual([tuple(shape) for shape in host.conv_state_shapes], [CONV_SHAPE])
        self.assertEqual(host.temporal_device_ptrs.tolist(), [v.data_ptr() for v in temporal])
        kernels = self._round_trip(device_pool, host, [*temporal, *conv[0]])
        cell_bytes = temporal[0].stride(0) * 2
        self.assertEqual(set(kernels.strides), {cell_bytes})

    def test_stacked_dense_pools_keep_their_item_size_as_the_stride(self):
        temporal = torch.randn(NUM_LAYERS, SLOTS, *TEMPORAL_SHAPE).to(torch.float16)
        conv = [torch.randn(NUM_LAYERS, SLOTS, *CONV_SHAPE).to(torch.float16)]
        cache = SimpleNamespace(
            temporal=temporal,
            conv=conv,
            at_layer_idx=lambda layer: _LayerState(temporal[layer], [c[layer] for c in conv]),
        )
        device_pool = _device_pool(cache)
        host = self._host(device_pool)
        kernels = self._round_trip(device_pool, host, [*temporal, *conv[0]])
        self.assertEqual(set(kernels.strides), {128, 96})

    def test_a_host_pool_built_without_init_reads_the_stacked_tensors(self):
        # As SGLang's Mamba JIT transfer kernel tests build their host pool.
        temporal = torch.randn(NUM_LAYERS, SLOTS, *TEMPORAL_SHAPE).to(torch.float16)
        conv = [torch.randn(NUM_LAYERS, SLOTS, *CONV_SHAPE).to(torch.float16)]
        device_pool = SimpleNamespace(
            mamba_cache=SimpleNamespace(temporal=temporal, conv=conv), size=SLOTS, device="cpu"
        )
        host = mamba_pool_host.MambaPoolHost.__new__(mamba_pool_host.MambaPoolHost)
        host.layout, host.page_size, host.size, host.device = "page_first", 1, SLOTS, "cpu"
        host.num_mamba_layers = NUM_LAYERS
        host.conv_state_shapes, host.temporal_state_shape = [CONV_SHAPE], TEMPORAL_SHAPE
        host.temporal_state_elem_size = 64
        host.temporal_buffer = torch.zeros(SLOTS, NUM_LAYERS, 1, *TEMPORAL_SHAPE, dtype=torch.float16)
        host.conv_buffer = [torch.zeros(SLOTS, NUM_LAYERS, 1, *CONV_SHAPE, dtype=torch.float16)]
        host.temporal_staging_buffer, host.conv_staging_buffers = None, [None]
        host._temporal_can_use_jit, host._conv_can_use_jit = False, [False]
        host.device_pool = device_pool
        host.temporal_device_ptrs = torch.tensor([t.data_ptr() for t in temporal], dtype=torch.uint64)
        host.conv_device_ptrs = [torch.tensor([c.data_ptr() for c in conv[0]], dtype=torch.uint64)]
        host.lock = threading.RLock()
        host.clear()
        self._round_trip(device_pool, host, [*temporal, *conv[0]])

    def test_strided_slots_with_page_first_direct_are_refused_at_startup(self):
        temporal, conv = _padded_cells()
        with self.assertRaisesRegex(ValueError, "page_first_direct .* copies Mamba temporal state as dense slots"):
            self._host(_device_pool(_PerLayerCache(temporal, conv)), layout="page_first_direct")

    def test_slots_not_16_byte_aligned_are_refused_at_startup(self):
        cell = torch.zeros(SLOTS, NUM_LAYERS * 64 + 3, dtype=torch.float16)  # 6 bytes of padding a slot
        temporal = [cell[:, l * 64 : (l + 1) * 64].view(SLOTS, *TEMPORAL_SHAPE) for l in range(NUM_LAYERS)]
        conv = [[torch.zeros(SLOTS, *CONV_SHAPE, dtype=torch.float16) for _ in range(NUM_LAYERS)]]
        with self.assertRaisesRegex(ValueError, "need a multiple of 16"):
            self._host(_device_pool(_PerLayerCache(temporal, conv)))


if __name__ == "__main__":
    unittest.main()
