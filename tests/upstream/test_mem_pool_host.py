"""Unit tests for HiCache host pools over strided device views.

Additions to SGLang's test/registered/unit/mem_cache/test_mem_pool_host.py.

A device pool may hand out per-layer views into one buffer that interleaves
the layers: each row (one token's K, V or latent; one slot's Mamba state) is
packed, but a layer's rows lie one interleaved record apart. The host pools
read that stride from the views at construction, copy by it, and refuse what
no stride-aware copy serves before any host memory is allocated.

The JIT copy kernels are replaced by exact torch references: they resolve the
pointers they are given over the test's buffers and step rows by the strides
they are given, as the CUDA kernels do, so a wrong stride shows up as wrong
bytes.
"""

import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.kernels.ops.kvcache import hicache
from sglang.kernels.ops.mamba import transfer_mamba
from sglang.srt.mem_cache.memory_pool import MambaPool
from sglang.srt.mem_cache.pool_host import common as host_common
from sglang.srt.mem_cache.pool_host import mamba as mamba_host
from sglang.srt.mem_cache.pool_host import mha as mha_host
from sglang.srt.mem_cache.pool_host import mla as mla_host
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

LAYERS, ROWS, PAGE = 3, 32, 4
HEADS, HEAD_DIM = 2, 64  # a 256-byte bf16 K or V row
KV_LORA_RANK, ROPE_DIM = 512, 64  # a 1152-byte bf16 MLA row
DEVICE_ROWS = torch.tensor([4, 5, 6, 7, 20, 21, 22, 23])


class _Memory:
    """Byte views of the test's buffers at the raw addresses kernels receive."""

    def __init__(self):
        self.storages = {}

    def add(self, *tensors):
        for tensor in tensors:
            storage = tensor.untyped_storage()
            byte_view = torch.empty(0, dtype=torch.uint8).set_(storage)
            self.storages[storage.data_ptr()] = byte_view

    def rows(self, address, stride_bytes, row_bytes, count):
        for begin, storage in self.storages.items():
            if begin <= address < begin + storage.numel():
                last = address - begin + (count - 1) * stride_bytes + row_bytes
                assert last <= storage.numel(), "rows past the end of a buffer"
                return storage.as_strided(
                    (count, row_bytes), (stride_bytes, 1), address - begin
                )
        raise AssertionError(f"address {address:#x} lies in no buffer of the test")


class _HiCacheKernels:
    """The JIT HiCache kernel modules (hicache.cuh, staged_write_back.cuh) in torch."""

    def __init__(self, memory):
        self.memory = memory
        self.element_size = None
        self.launches = []

    def load(self, *, element_size, unroll, block_quota):
        self.element_size = element_size
        return self

    def _rows(self, address, stride_bytes, indices):
        count = int(indices.max()) + 1
        return self.memory.rows(address, stride_bytes, self.element_size, count)

    def _all_layers(self, ptr_dst, idx_dst, ptr_src, idx_src, src_stride, dst_stride):
        for dst, src in zip(ptr_dst.tolist(), ptr_src.tolist(), strict=True):
            rows = self._rows(src, src_stride, idx_src)[idx_src]
            self._rows(dst, dst_stride, idx_dst)[idx_dst] = rows

    def _staged(self, dst, idx_dst, staging, pages_src, ptr_src, page_size, stride):
        tokens = (pages_src[:, None] + torch.arange(page_size)).flatten()
        staged = staging.view(torch.uint8)
        for layer, src in enumerate(ptr_src.tolist()):
            staged[:, layer] = self._rows(src, stride, tokens)[tokens]
        dst.view(torch.uint8)[idx_dst] = staged

    def launch_one(self, k_dst, v_dst, idx_dst, k_src, v_src, idx_src):
        self.launches.append("one")
        k_dst[idx_dst] = k_src[idx_src]
        v_dst[idx_dst] = v_src[idx_src]

    def launch_one_mla(self, dst, idx_dst, src, idx_src):
        self.launches.append("one")
        dst[idx_dst] = src[idx_src]

    def launch_all(self, k_dst, v_dst, idx_dst, k_src, v_src, idx_src, *strides):
        self.launches.append("all")
        self._all_layers(k_dst, idx_dst, k_src, idx_src, *strides)
        self._all_layers(v_dst, idx_dst, v_src, idx_src, *strides)

    def launch_all_mla(self, ptr_dst, idx_dst, ptr_src, idx_src, *strides):
        self.launches.append("all")
        self._all_layers(ptr_dst, idx_dst, ptr_src, idx_src, *strides)

    # Without a source stride, the staged relayout steps rows by the element size.
    def launch_all_lf_pf_staged(
        self,
        k_dst,
        v_dst,
        idx_dst,
        k_stg,
        v_stg,
        pages,
        k_src,
        v_src,
        page_size,
        stride=None,
    ):
        self.launches.append("staged")
        stride = self.element_size if stride is None else stride
        self._staged(k_dst, idx_dst, k_stg, pages, k_src, page_size, stride)
        self._staged(v_dst, idx_dst, v_stg, pages, v_src, page_size, stride)

    def launch_all_mla_lf_pf_staged(
        self, dst, idx_dst, staging, pages, ptr_src, page_size, stride=None
    ):
        self.launches.append("staged")
        stride = self.element_size if stride is None else stride
        self._staged(dst, idx_dst, staging, pages, ptr_src, page_size, stride)


def _ptr_table(views):
    return torch.tensor([view.data_ptr() for view in views], dtype=torch.uint64)


def _kv_views(kinds, layers, row_shape, strided):
    """Each kind's per-layer views: into one (rows, layers, kinds, *row) buffer
    when strided, as an elastic pool allocates them, else one tensor each."""
    if strided:
        whole = torch.randn(ROWS, layers, kinds, *row_shape).to(torch.bfloat16)
        return [
            [whole[:, layer, kind] for layer in range(layers)] for kind in range(kinds)
        ]
    return [
        [torch.randn(ROWS, *row_shape).to(torch.bfloat16) for _ in range(layers)]
        for _ in range(kinds)
    ]


def _device_pool(layers, **attrs):
    return SimpleNamespace(
        layer_num=layers,
        start_layer=0,
        end_layer=layers - 1,
        size=ROWS - PAGE,
        store_dtype=torch.bfloat16,
        device="cpu",
        layer_shard_enabled=False,
        **attrs,
    )


def _mha_device_pool(
    layers=LAYERS, strided=True, pointer_tables=True, head_dim=HEAD_DIM
):
    k, v = _kv_views(2, layers, (HEADS, head_dim), strided)
    pool = _device_pool(
        layers,
        head_num=HEADS,
        head_dim=head_dim,
        v_head_dim=head_dim,
        k_buffer=k,
        v_buffer=v,
    )
    if pointer_tables:
        pool.k_data_ptrs, pool.v_data_ptrs = _ptr_table(k), _ptr_table(v)
    return pool


def _mla_device_pool(layers=LAYERS, strided=True, rope_dim=ROPE_DIM):
    (kv,) = _kv_views(1, layers, (1, KV_LORA_RANK + rope_dim), strided)
    return _device_pool(
        layers,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=rope_dim,
        kv_buffer=kv,
        data_ptrs=_ptr_table(kv),
    )


class _HostPoolStridedRowsMixin:
    """Cases shared by the MHA and MLA host pools."""

    host_module = host_cls = make_device_pool = None
    row_bytes = rows_per_token = rows_without_jit_kernel = refused_layouts = None

    def setUp(self):
        super().setUp()
        self.memory = _Memory()
        self.kernels = _HiCacheKernels(self.memory)
        for patch in (
            mock.patch.object(self.host_module, "_is_cuda", True),
            mock.patch.object(hicache, "_jit_hicache_module", self.kernels.load),
            mock.patch.object(hicache, "_jit_hicache_staged_module", self.kernels.load),
        ):
            patch.start()
            self.addCleanup(patch.stop)

    @staticmethod
    def _views(pool):
        if hasattr(pool, "kv_buffer"):
            return list(pool.kv_buffer)
        return [*pool.k_buffer, *pool.v_buffer]

    def _host(self, device_pool, layout, drafts=()):
        self.memory.add(
            *[v for pool in (device_pool, *drafts) for v in self._views(pool)]
        )
        host = self.host_cls(
            device_pool,
            2.0,
            0,
            PAGE,
            layout,
            pin_memory=False,
            device="cpu",
            mtp_draft_device_pools=drafts,
        )
        self.memory.add(host.kv_buffer)
        return host

    def _assert_round_trip(self, host, device_pool, drafts=()):
        views = [v for pool in (device_pool, *drafts) for v in self._views(pool)]
        before = [view.clone() for view in views]
        host_rows = host.alloc(len(DEVICE_ROWS))
        host.backup_from_device_all_layer(device_pool, host_rows, DEVICE_ROWS, "kernel")
        for view in views:
            view.zero_()
        for layer in range(device_pool.layer_num):
            host.load_to_device_per_layer(
                device_pool, host_rows, DEVICE_ROWS, layer, "kernel"
            )
        for index, draft in enumerate(drafts):
            host.load_to_device_per_layer(
                draft,
                host_rows,
                DEVICE_ROWS,
                device_pool.layer_num + index,
                "kernel",
                is_draft=True,
            )
        for view, was in zip(views, before, strict=True):
            expected = torch.zeros_like(was)
            expected[DEVICE_ROWS] = was[DEVICE_ROWS]
            torch.testing.assert_close(view, expected, rtol=0, atol=0)

    def _assert_refused_before_allocation(
        self, message, device_pool, layout, drafts=()
    ):
        alloc = mock.Mock(wraps=host_common.ALLOC_MEMORY_FUNCS["cpu"])
        with mock.patch.dict(host_common.ALLOC_MEMORY_FUNCS, {"cpu": alloc}):
            with self.assertRaisesRegex(ValueError, message):
                self._host(device_pool, layout, drafts)
        alloc.assert_not_called()

    def test_strided_rows_round_trip(self):
        for layout in ("layer_first", "page_first"):
            with self.subTest(layout=layout):
                device_pool = self.make_device_pool()
                host = self._host(device_pool, layout)
                self._assert_round_trip(host, device_pool)

    def test_packed_rows_round_trip(self):
        for layout in ("layer_first", "page_first"):
            with self.subTest(layout=layout):
                device_pool = self.make_device_pool(strided=False)
                host = self._host(device_pool, layout)
                self._assert_round_trip(host, device_pool)

    def test_startup_logs_the_row_stride(self):
        # One token's rows of every layer (and K and V) lie between two rows.
        stride = LAYERS * self.rows_per_token * self.row_bytes
        with self.assertLogs("sglang.srt.mem_cache.pool_host.base", "INFO") as logs:
            self._host(self.make_device_pool(), "page_first")
        self.assertRegex("\n".join(logs.output), rf"strided \({stride} B apart\)")

    def test_host_layouts_without_a_strided_copy_are_refused(self):
        for layout in self.refused_layouts:
            with self.subTest(layout=layout):
                self._assert_refused_before_allocation(
                    f"--hicache-mem-layout {layout} cannot copy",
                    self.make_device_pool(),
                    layout,
                )

    def test_rows_the_jit_kernel_cannot_take_are_refused(self):
        # The JIT HiCache kernels copy rows of a multiple of 128 bytes.
        self._assert_refused_before_allocation(
            "only the JIT HiCache kernels copy",
            self.make_device_pool(**self.rows_without_jit_kernel),
            "layer_first",
        )


class TestMHAHostPoolStridedDeviceRows(_HostPoolStridedRowsMixin, CustomTestCase):
    host_module = mha_host
    host_cls = mha_host.MHATokenToKVPoolHost
    make_device_pool = staticmethod(_mha_device_pool)
    row_bytes, rows_per_token = HEADS * HEAD_DIM * 2, 2
    rows_without_jit_kernel = {"head_dim": 40}  # 160-byte rows
    refused_layouts = ("page_first_direct", "page_head")

    def test_views_without_one_row_stride_are_refused(self):
        device_pool = _mha_device_pool()
        device_pool.v_buffer = [view.clone() for view in device_pool.v_buffer]
        self._assert_refused_before_allocation(
            "do not share one row stride", device_pool, "layer_first"
        )

    def test_a_pool_without_pointer_tables_round_trips(self):
        for layout in ("layer_first", "page_first"):
            with self.subTest(layout=layout):
                device_pool = _mha_device_pool(pointer_tables=False)
                host = self._host(device_pool, layout)
                try:
                    self._assert_round_trip(host, device_pool)
                except AttributeError as error:
                    self.fail(f"the host pool needs the pool's pointer tables: {error}")

    def test_packed_draft_layers_of_another_stride_round_trip(self):
        # A one-layer MTP draft pool interleaves fewer layers than its target:
        # its rows lie closer together.
        for layout in ("layer_first", "page_first"):
            with self.subTest(layout=layout):
                device_pool, drafts = _mha_device_pool(), [_mha_device_pool(layers=1)]
                host = self._host(device_pool, layout, drafts)
                self._assert_round_trip(host, device_pool, drafts)

    def test_draft_layers_of_one_stride_are_backed_up_in_one_launch(self):
        for layout in ("layer_first", "page_first"):
            with self.subTest(layout=layout):
                device_pool = _mha_device_pool()
                drafts = [_mha_device_pool(layers=1), _mha_device_pool(layers=1)]
                host = self._host(device_pool, layout, drafts)
                self.kernels.launches.clear()
                self._assert_round_trip(host, device_pool, drafts)
                # The target's layers in one launch, both drafts' in another.
                self.assertEqual(self.kernels.launches.count("all"), 2)


class TestMLAHostPoolStridedDeviceRows(_HostPoolStridedRowsMixin, CustomTestCase):
    host_module = mla_host
    host_cls = mla_host.MLATokenToKVPoolHost
    make_device_pool = staticmethod(_mla_device_pool)
    row_bytes, rows_per_token = (KV_LORA_RANK + ROPE_DIM) * 2, 1
    rows_without_jit_kernel = {"rope_dim": 8}  # 1040-byte rows
    refused_layouts = ("page_first_direct",)

    def test_draft_pools_of_another_stride_are_refused(self):
        self._assert_refused_before_allocation(
            "strided by different amounts",
            _mla_device_pool(),
            "layer_first",
            drafts=[_mla_device_pool(layers=1)],
        )


TEMPORAL_SHAPE, CONV_SHAPE = (4, 16), (2, 24)  # 128 and 96 bytes of fp16
TEMPORAL_ELEMS, CONV_ELEMS = 64, 48
SLOTS = 8
DEVICE_SLOTS = torch.tensor([1, 5, 6])


class _MambaTransferKernels:
    """The JIT Mamba state transfer module (transfer_mamba.cuh) in torch."""

    def __init__(self, memory):
        self.memory = memory

    def _slots(self, address, stride_bytes, item_size, indices):
        # Without a device slot stride, the kernels step slots by item_size.
        stride_bytes = item_size if stride_bytes is None else stride_bytes
        count = int(indices.max()) + 1
        return self.memory.rows(address, stride_bytes, item_size, count)

    def transfer_kv_mamba_lf_pf(
        self,
        src_ptrs,
        dst,
        src_idx,
        dst_idx,
        item_size,
        layout_dim,
        layers,
        stride=None,
    ):
        host = dst.reshape(dst.shape[0], -1).view(torch.uint8)
        assert host.shape[1] == layout_dim
        for layer, address in enumerate(src_ptrs.tolist()):
            slots = self._slots(address, stride, item_size, src_idx)
            host[dst_idx, layer * item_size : (layer + 1) * item_size] = slots[src_idx]

    def transfer_kv_mamba_pf_lf(
        self, src, dst, src_idx, dst_idx, layer, item_size, layout_dim, stride=None
    ):
        host = src.reshape(src.shape[0], -1).view(torch.uint8)
        assert host.shape[1] == layout_dim
        slots = self._slots(dst.data_ptr(), stride, item_size, dst_idx)
        slots[dst_idx] = host[src_idx, layer * item_size : (layer + 1) * item_size]


def _mamba_cells(padding=16, layers=LAYERS):
    """Each slot's states for every layer in one cell of `padding` spare fp16
    elements: (layers, slots, *shape) state tensors with strided slots."""
    state_elems = layers * (TEMPORAL_ELEMS + CONV_ELEMS)
    cell = torch.randn(SLOTS, state_elems + padding).to(torch.float16)
    temporal = cell[:, : layers * TEMPORAL_ELEMS].view(SLOTS, layers, *TEMPORAL_SHAPE)
    conv = cell[:, layers * TEMPORAL_ELEMS : state_elems].view(
        SLOTS, layers, *CONV_SHAPE
    )
    return temporal.transpose(0, 1), conv.transpose(0, 1)


def _mamba_device_pool(temporal, conv):
    """A MambaPool over stacked (layers, slots, *shape) state tensors."""
    pool = MambaPool.__new__(MambaPool)
    pool.mamba_cache = MambaPool.State(conv=[conv], temporal=temporal)
    pool.num_mamba_layers, pool.size, pool.device = len(temporal), SLOTS - 1, "cpu"
    return pool


def _per_layer_device_pool(temporal_layers, conv_layers):
    """A Mamba pool that allocates its layers apart: its states are reachable
    through mamba2_layer_cache(), its mamba_cache holds only layer 0's."""
    return SimpleNamespace(
        mamba_cache=MambaPool.State(conv=[conv_layers[0]], temporal=temporal_layers[0]),
        mamba2_layer_cache=lambda layer: MambaPool.State(
            conv=[conv_layers[layer]], temporal=temporal_layers[layer]
        ),
        num_mamba_layers=len(temporal_layers),
        size=SLOTS - 1,
        device="cpu",
    )


class _MambaHostPoolCase(CustomTestCase):
    def setUp(self):
        super().setUp()
        self.memory = _Memory()
        kernels = _MambaTransferKernels(self.memory)
        for patch in (
            mock.patch.object(
                transfer_mamba, "_jit_transfer_mamba_module", return_value=kernels
            ),
            mock.patch.object(
                mamba_host,
                "transfer_kv_mamba_lf_pf",
                transfer_mamba.transfer_kv_mamba_lf_pf,
                create=True,
            ),
            mock.patch.object(
                mamba_host,
                "transfer_kv_mamba_pf_lf",
                transfer_mamba.transfer_kv_mamba_pf_lf,
                create=True,
            ),
        ):
            patch.start()
            self.addCleanup(patch.stop)

    def _host(self, device_pool, layout="page_first"):
        return mamba_host.MambaPoolHost(
            device_pool, 2.0, 0, pin_memory=False, device="cpu", layout=layout
        )

    def _assert_round_trip(self, device_pool, host, views):
        self.memory.add(*views, *host.kv_buffer)
        before = [view.clone() for view in views]
        host_slots = host.alloc(len(DEVICE_SLOTS))
        host.backup_from_device_all_layer(device_pool, host_slots, DEVICE_SLOTS)
        for view in views:
            view.zero_()
        for layer in range(LAYERS):
            host.load_to_device_per_layer(device_pool, host_slots, DEVICE_SLOTS, layer)
        for view, was in zip(views, before, strict=True):
            expected = torch.zeros_like(was)
            expected[DEVICE_SLOTS] = was[DEVICE_SLOTS]
            torch.testing.assert_close(view, expected, rtol=0, atol=0)

    def _assert_refused_before_allocation(self, message, device_pool, layout):
        alloc = mock.Mock(wraps=host_common.ALLOC_MEMORY_FUNCS["cpu"])
        with mock.patch.dict(host_common.ALLOC_MEMORY_FUNCS, {"cpu": alloc}):
            with self.assertRaisesRegex(ValueError, message):
                self._host(device_pool, layout)
        alloc.assert_not_called()


class TestMambaHostPoolStridedDeviceSlots(_MambaHostPoolCase):
    def test_strided_slots_round_trip(self):
        temporal, conv = _mamba_cells()
        device_pool = _mamba_device_pool(temporal, conv)
        self._assert_round_trip(
            device_pool, self._host(device_pool), [*temporal, *conv]
        )

    def test_packed_slots_round_trip(self):
        temporal = torch.randn(LAYERS, SLOTS, *TEMPORAL_SHAPE).to(torch.float16)
        conv = torch.randn(LAYERS, SLOTS, *CONV_SHAPE).to(torch.float16)
        device_pool = _mamba_device_pool(temporal, conv)
        self._assert_round_trip(
            device_pool, self._host(device_pool), [*temporal, *conv]
        )

    def test_startup_logs_the_slot_stride(self):
        cell_bytes = (LAYERS * (TEMPORAL_ELEMS + CONV_ELEMS) + 16) * 2
        with self.assertLogs("sglang.srt.mem_cache.pool_host.mamba", "INFO") as logs:
            self._host(_mamba_device_pool(*_mamba_cells()))
        self.assertRegex("\n".join(logs.output), rf"strided \({cell_bytes} B apart\)")

    def test_page_first_direct_is_refused(self):
        # sglang-kernel's direct copies take packed slots.
        self._assert_refused_before_allocation(
            "--hicache-mem-layout page_first_direct cannot copy",
            _mamba_device_pool(*_mamba_cells()),
            "page_first_direct",
        )

    def test_slots_not_16_byte_aligned_are_refused(self):
        self._assert_refused_before_allocation(
            "need slots 16-byte aligned",
            _mamba_device_pool(*_mamba_cells(padding=4)),  # 8 spare bytes a cell
            "page_first",
        )

    def test_slots_whose_state_is_not_packed_are_refused(self):
        temporal, conv = _mamba_cells()
        temporal = temporal.transpose(2, 3)  # each slot's state strided too
        self._assert_refused_before_allocation(
            "do not share one slot stride",
            _mamba_device_pool(temporal, conv),
            "page_first",
        )


class TestMambaHostPoolPerLayerDeviceState(_MambaHostPoolCase):
    def _layers_apart(self):
        temporal = [
            torch.randn(SLOTS, *TEMPORAL_SHAPE).to(torch.float16) for _ in range(LAYERS)
        ]
        conv = [
            torch.randn(SLOTS, *CONV_SHAPE).to(torch.float16) for _ in range(LAYERS)
        ]
        return temporal, conv

    def test_layers_allocated_apart_round_trip(self):
        for name, (temporal, conv) in (
            ("packed", self._layers_apart()),
            ("strided", [list(states) for states in _mamba_cells()]),
        ):
            with self.subTest(slots=name):
                device_pool = _per_layer_device_pool(temporal, conv)
                host = self._host(device_pool)
                self.assertEqual(tuple(host.temporal_state_shape), TEMPORAL_SHAPE)
                self.assertEqual(
                    [tuple(s) for s in host.conv_state_shapes], [CONV_SHAPE]
                )
                self._assert_round_trip(device_pool, host, [*temporal, *conv])

    def test_layers_of_different_slot_strides_are_refused(self):
        temporal, conv = self._layers_apart()
        temporal[1] = _mamba_cells(layers=1)[0][0]
        self._assert_refused_before_allocation(
            "do not share one slot stride",
            _per_layer_device_pool(temporal, conv),
            "page_first",
        )


if __name__ == "__main__":
    unittest.main()
