"""Unit tests for the asymmetric MHA host pool over strided device views.

Additions to SGLang's
test/registered/unit/mem_cache/test_asymmetric_mha_pool_host_unit.py.

The host pool of models with head_dim != v_head_dim copies K and V with
sglang-kernel's kernels, which address device rows as packed. Per-layer views
into one buffer that interleaves the layers are refused at construction, in
every host layout, before any host memory is allocated.
"""

import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.srt.mem_cache.pool_host import common as host_common
from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

LAYERS, ROWS, PAGE, HEADS, K_DIM, V_DIM = 3, 16, 2, 2, 8, 4


def _device_pool(strided):
    if strided:
        # One buffer of every layer's K and V rows for each token.
        whole = torch.randn(ROWS, LAYERS, HEADS * (K_DIM + V_DIM)).to(torch.float16)
        k = [
            whole[:, i, : HEADS * K_DIM].view(ROWS, HEADS, K_DIM) for i in range(LAYERS)
        ]
        v = [
            whole[:, i, HEADS * K_DIM :].view(ROWS, HEADS, V_DIM) for i in range(LAYERS)
        ]
    else:
        k = [torch.randn(ROWS, HEADS, K_DIM).to(torch.float16) for _ in range(LAYERS)]
        v = [torch.randn(ROWS, HEADS, V_DIM).to(torch.float16) for _ in range(LAYERS)]
    return SimpleNamespace(
        layer_num=LAYERS,
        start_layer=0,
        end_layer=LAYERS - 1,
        size=ROWS - PAGE,
        store_dtype=torch.float16,
        device="cpu",
        layer_shard_enabled=False,
        head_num=HEADS,
        head_dim=K_DIM,
        v_head_dim=V_DIM,
        k_buffer=k,
        v_buffer=v,
        k_data_ptrs=torch.tensor([x.data_ptr() for x in k], dtype=torch.uint64),
        v_data_ptrs=torch.tensor([x.data_ptr() for x in v], dtype=torch.uint64),
    )


def _host(device_pool, layout):
    return AsymmetricMHATokenToKVPoolHost(
        device_pool, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu"
    )


class TestAsymmetricMHAHostPoolStridedDeviceViews(CustomTestCase):
    def test_strided_device_views_are_refused_before_allocation(self):
        for layout in ("page_first", "page_first_direct"):
            with self.subTest(layout=layout):
                alloc = mock.Mock(wraps=host_common.ALLOC_MEMORY_FUNCS["cpu"])
                with mock.patch.dict(host_common.ALLOC_MEMORY_FUNCS, {"cpu": alloc}):
                    with self.assertRaisesRegex(
                        ValueError, "head_dim != v_head_dim cannot copy"
                    ):
                        _host(_device_pool(strided=True), layout)
                alloc.assert_not_called()

    def test_packed_device_views_are_served(self):
        for layout in ("page_first", "page_first_direct"):
            with self.subTest(layout=layout):
                host = _host(_device_pool(strided=False), layout)
                self.assertEqual(host.k_buffer.shape[-1], K_DIM)
                self.assertEqual(host.v_buffer.shape[-1], V_DIM)


if __name__ == "__main__":
    unittest.main()
