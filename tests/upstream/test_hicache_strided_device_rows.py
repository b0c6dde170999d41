"""Unit tests for HiCache host pools over strided device KV views.

Some device pools reserve virtual memory for every layer at once and hand out
per-layer views into one buffer that interleaves the layers (kvcached's elastic
pools): each token's row is dense, but consecutive rows of a layer lie one
interleaved record apart. The MHA and MLA host pools must find that stride in the
views, copy with it, and refuse at startup the layouts no stride-aware copy serves;
dense pools keep their exact path. The copy kernels are replaced by torch
references that resolve the pointer tables they are given and check the strides.
"""

import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.srt.mem_cache.pool_host import base as base_pool_host
from sglang.srt.mem_cache.pool_host import common as common_pool_host
from sglang.srt.mem_cache.pool_host import mha as mha_pool_host
from sglang.srt.mem_cache.pool_host import mla as mla_pool_host
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

LAYERS, TOKENS, PAGE, HEADS, HEAD_DIM, KV_DIM = 3, 32, 4, 2, 64, 576


def _interleaved(kinds, layers, row_shape, tokens=TOKENS):
    """Per kind, each layer's view into one buffer holding every layer and kind of a token."""
    whole = torch.randn(tokens, layers, kinds, *row_shape).to(torch.bfloat16)
    return [[whole[:, layer, kind] for layer in range(layers)] for kind in range(kinds)]


def _dense(kinds, layers, row_shape, tokens=TOKENS):
    return [
        [torch.randn(tokens, *row_shape).to(torch.bfloat16) for _ in range(layers)]
        for _ in range(kinds)
    ]


def _table(views):
    return torch.tensor([view.data_ptr() for view in views], dtype=torch.uint64)


def _mha_device_pool(strided, layers=LAYERS):
    make = _interleaved if strided else _dense
    k, v = make(2, layers, (HEADS, HEAD_DIM))
    pool = SimpleNamespace(
        layer_num=layers,
        store_dtype=torch.bfloat16,
        size=TOKENS - 2 * PAGE,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        start_layer=0,
        end_layer=layers - 1,
        device="cpu",
        k_buffer=k,
        v_buffer=v,
        layer_shard_enabled=False,
    )
    if not strided:  # SGLang's own pools publish pointer tables; strided views do not
        pool.k_data_ptrs, pool.v_data_ptrs = _table(k), _table(v)
    return pool


def _mla_device_pool(strided, layers=LAYERS):
    make = _interleaved if strided else _dense
    (kv,) = make(1, layers, (1, KV_DIM))
    return SimpleNamespace(
        layer_num=layers,
        store_dtype=torch.bfloat16,
        size=TOKENS - 2 * PAGE,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        start_layer=0,
        end_layer=layers - 1,
        device="cpu",
        kv_buffer=kv,
        data_ptrs=_table(kv),
        layer_shard_enabled=False,
    )


class _ReferenceKernels:
    """The JIT all-layer, one-layer and staged kernels as torch copies over the views
    their pointer tables name; each checks the device stride it is given."""

    def __init__(self, device_views, host_views):
        self.views = {view.data_ptr(): view for view in (*device_views, *host_views)}
        self.calls = []

    def _rows(self, table, stride_bytes):
        views = [self.views[ptr] for ptr in table.tolist()]
        for view in views:
            assert view.stride(0) * view.element_size() == stride_bytes
        return views

    def all_layer(self, *, indices_dst, indices_src, **kw):
        names = [("k_ptr", "kv_cache"), ("v_ptr", "kv_cache")] if "k_ptr_dst" in kw else [("ptr", "cache")]
        for ptr, cache in names:
            src = self._rows(kw[f"{ptr}_src"], kw[f"{cache}_src_stride_bytes"])
            dst = self._rows(kw[f"{ptr}_dst"], kw[f"{cache}_dst_stride_bytes"])
            for s, d in zip(src, dst, strict=True):
                d[indices_dst] = s[indices_src]
        self.calls.append(("all_layer", kw))

    def staged(self, *, src_indices, dst_indices, page_size, src_stride_bytes, **kw):
        for src_table, dst in ([("k_ptr_src", "dst_k"), ("v_ptr_src", "dst_v")] if "dst_k" in kw else [("ptr_src", "dst")]):
            for layer, view in enumerate(self._rows(kw[src_table], src_stride_bytes)):
                kw[dst][dst_indices, layer] = view[src_indices]
        self.calls.append(("staged", dict(kw, src_stride_bytes=src_stride_bytes)))

    def one_layer(self, **kw):
        pairs = (
            [("k_cache_dst", "k_cache_src"), ("v_cache_dst", "v_cache_src")]
            if "k_cache_dst" in kw
            else [("cache_dst", "cache_src")]
        )
        for dst, src in pairs:
            kw[dst][kw["indices_dst"]] = kw[src][kw["indices_src"]]


def _jit_patches(module, kernels, mla):
    suffix = "_mla" if mla else ""
    return [
        mock.patch.object(module, "_is_cuda", True),
        mock.patch.object(module, "can_use_hicache_jit_kernel", return_value=True),
        mock.patch.object(module, "can_use_write_back_jit_kernel", return_value=True),
        mock.patch.object(module, f"jit_transfer_hicache_all_layer{suffix}", side_effect=kernels.all_layer),
        mock.patch.object(module, f"jit_transfer_hicache_one_layer{suffix}", side_effect=kernels.one_layer),
        mock.patch.object(
            module, f"jit_transfer_hicache_all_layer{suffix}_staged_lf_pf", side_effect=kernels.staged
        ),
    ]


class _StridedDeviceRowsCase(CustomTestCase):
    mla = False

    def _make(self, layout, strided=True, drafts=()):
        module = mla_pool_host if self.mla else mha_pool_host
        target = (_mla_device_pool if self.mla else _mha_device_pool)(strided)
        draft_pools = [(_mla_device_pool if self.mla else _mha_device_pool)(s, layers=1) for s in drafts]
        pools = [target, *draft_pools]
        device_views = [v for p in pools for v in ([*p.kv_buffer] if self.mla else [*p.k_buffer, *p.v_buffer])]
        self.kernels = _ReferenceKernels(device_views, [])
        self.patches = _jit_patches(module, self.kernels, self.mla)
        for patch in self.patches:
            patch.start()
        self.addCleanup(lambda: [patch.stop() for patch in self.patches])
        cls = module.MLATokenToKVPoolHost if self.mla else module.MHATokenToKVPoolHost
        host = cls(
            target, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu", mtp_draft_device_pools=draft_pools
        )
        refs = host.data_refs if self.mla else host.k_data_refs + host.v_data_refs
        self.kernels.views.update({view.data_ptr(): view for view in refs})
        return target, draft_pools, host

    def _kinds(self, pool):
        return [pool.kv_buffer] if self.mla else [pool.k_buffer, pool.v_buffer]

    def _round_trip(self, layout, **make):
        target, drafts, host = self._make(layout, **make)
        pools = [target, *drafts]
        device_rows = torch.tensor([4, 5, 6, 7, 20, 21, 22, 23])
        host_rows = torch.tensor([8, 9, 10, 11, 12, 13, 14, 15])
        expected = [[view[device_rows].clone() for view in kind] for pool in pools for kind in self._kinds(pool)]
        host.backup_from_device_all_layer(target, host_rows, device_rows, "kernel")
        for pool in pools:
            for kind in self._kinds(pool):
                for view in kind:
                    view.zero_()
        for layer in range(target.layer_num):
            host.load_to_device_per_layer(target, host_rows, device_rows, layer, "kernel")
        for layer, draft in enumerate(drafts):
            host.load_to_device_per_layer(
                draft, host_rows, device_rows, target.layer_num + layer, "kernel", is_draft=True
            )
        actual = [[view[device_rows] for view in kind] for pool in pools for kind in self._kinds(pool)]
        for want, got in zip(expected, actual, strict=True):
            for w, g in zip(want, got, strict=True):
                self.assertTrue(torch.equal(w, g))
        return host

    def test_strided_views_round_trip_through_the_staged_write_back(self):
        host = self._round_trip("page_first")
        (run,) = host.device_layer_runs
        self.assertEqual(run.row_stride_bytes, self._kinds_stride())
        staged = [kw for name, kw in self.kernels.calls if name == "staged"]
        self.assertEqual([kw["src_stride_bytes"] for kw in staged], [self._kinds_stride()])

    def test_strided_views_round_trip_layer_first(self):
        host = self._round_trip("layer_first")
        stride = self._kinds_stride()
        (name, kw), = self.kernels.calls
        self.assertEqual(name, "all_layer")
        self.assertEqual(kw["kv_cache_src_stride_bytes" if not self.mla else "cache_src_stride_bytes"], stride)
        self.assertIsNotNone(host.device_layer_runs)

    def test_packed_drafts_of_another_stride_back_up_run_by_run(self):
        host = self._round_trip("page_first", drafts=(True,))
        self.assertFalse(host.can_use_write_back_jit)  # one stride per staged write-back
        self.assertEqual([run.layers for run in host.device_layer_runs], [slice(0, LAYERS), slice(LAYERS, LAYERS + 1)])
        self.assertEqual([name for name, _ in self.kernels.calls], ["all_layer", "all_layer"])

    def test_dense_views_keep_the_device_pools_pointer_tables(self):
        target, _, host = self._make("page_first", strided=False)
        self.assertIsNone(host.device_layer_runs)
        host.backup_from_device_all_layer(target, torch.arange(PAGE), torch.arange(PAGE), "kernel")
        ((_, kw),) = self.kernels.calls
        if self.mla:
            self.assertIs(kw["ptr_src"], target.data_ptrs)
        else:
            self.assertIs(kw["k_ptr_src"], target.k_data_ptrs)
            self.assertIs(kw["v_ptr_src"], target.v_data_ptrs)
        self.assertEqual(kw["src_stride_bytes"], host.token_stride_size)

    def test_a_host_pool_built_without_init_keeps_the_dense_path(self):
        cls = mla_pool_host.MLATokenToKVPoolHost if self.mla else mha_pool_host.MHATokenToKVPoolHost
        self.assertIsNone(cls.__new__(cls).device_layer_runs)

    def test_page_first_direct_is_refused_at_startup(self):
        with self.assertRaisesRegex(ValueError, "page_first_direct has no copy path.*Use --hicache-mem-layout"):
            self._make("page_first_direct")

    def test_strided_views_without_the_jit_kernel_are_refused_at_startup(self):
        module = mla_pool_host if self.mla else mha_pool_host
        with mock.patch.object(module, "can_use_hicache_jit_kernel", return_value=False):
            with self.assertRaisesRegex(ValueError, "JIT HiCache kernel, which is unavailable"):
                cls = module.MLATokenToKVPoolHost if self.mla else module.MHATokenToKVPoolHost
                cls(
                    (_mla_device_pool if self.mla else _mha_device_pool)(True),
                    2.0, 0, PAGE, "layer_first", pin_memory=False, device="cpu",
                )

    def test_a_refused_pool_unpins_the_host_buffers_it_pinned(self):
        # The refusals come after __init__ pinned the host buffers; left pinned, the
        # registration outlives the freed memory and the next host pool allocated
        # there cannot pin it (cudaErrorHostMemoryAlreadyRegistered).
        module = mla_pool_host if self.mla else mha_pool_host
        cls = module.MLATokenToKVPoolHost if self.mla else module.MHATokenToKVPoolHost
        refusals = [
            ("page_first_direct", True, "page_first_direct has no copy path"),
            ("layer_first", False, "JIT HiCache kernel, which is unavailable"),
        ]
        for layout, jit, message in refusals:
            with self.subTest(layout=layout, jit=jit):
                pinned, registrations = {}, []

                def register(buffer, registration_granularity_bytes=None):
                    registrations.append(buffer.data_ptr())
                    pinned[buffer.data_ptr()] = buffer

                def unregister(buffer):
                    del pinned[buffer.data_ptr()]

                with mock.patch.object(common_pool_host, "_cuda_host_register", register), mock.patch.object(
                    base_pool_host, "_cuda_host_unregister", unregister
                ), mock.patch.object(base_pool_host, "_is_cuda", True), mock.patch.object(
                    module, "can_use_hicache_jit_kernel", return_value=jit
                ), mock.patch.object(module, "_is_cuda", True):
                    with self.assertRaisesRegex(ValueError, message):
                        cls(
                            (_mla_device_pool if self.mla else _mha_device_pool)(True),
                            2.0, 0, PAGE, layout, pin_memory=True, device="cpu",
                        )
                self.assertTrue(registrations)
                self.assertEqual(pinned, {})

    def _kinds_stride(self):
        row = KV_DIM * 2 if self.mla else HEADS * HEAD_DIM * 2
        return LAYERS * (1 if self.mla else 2) * row


class TestMHAHostPoolStridedDeviceRows(_StridedDeviceRowsCase):
    mla = False

    def test_page_head_is_refused_with_the_per_layer_remedy(self):
        with self.assertRaisesRegex(ValueError, "page_head has no copy path.*KVCACHED_CONTIGUOUS_LAYOUT=false"):
            self._make("page_head")


class TestMLAHostPoolStridedDeviceRows(_StridedDeviceRowsCase):
    mla = True


del _StridedDeviceRowsCase

if __name__ == "__main__":
    unittest.main()
