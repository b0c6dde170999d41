"""Unit tests for the staged page_first write-back over strided device rows.

The staged write-back gathers a chunk of pages from every device layer into a
staging buffer, then copies it to the page_first host pool. Its source rows lie
`src_stride_bytes` apart: the element size for dense layers (the default), more for
per-layer views into a buffer that interleaves the layers. The wrapper passes the
stride to the kernel (CPU test, the JIT module mocked); the kernel reads rows by it
(CUDA test).
"""

import unittest
from unittest import mock

import pytest
import torch

from sglang.kernels.ops.kvcache import hicache
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")
register_cuda_ci(est_time=20, stage="base-b-kernel-unit", runner_config="1-gpu-large")

LAYERS, PAGE, HEADS, HEAD_DIM, TOKENS = 3, 4, 2, 64, 64
ELEMENT = HEADS * HEAD_DIM * 2  # bf16 bytes of one token's row in one layer


def _pages(pages, page_size=PAGE, device="cpu"):
    return torch.tensor([p * page_size + t for p in pages for t in range(page_size)], device=device)


def _interleaved(kinds, device):
    """Per kind, each layer's view into one buffer holding every layer and kind of a token."""
    whole = torch.randn(TOKENS, LAYERS, kinds, HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    return [[whole[:, layer, kind] for layer in range(LAYERS)] for kind in range(kinds)], LAYERS * kinds * ELEMENT


def _table(views):
    return torch.tensor([v.data_ptr() for v in views], dtype=torch.uint64, device=views[0].device)


class TestStagedWriteBackStrideArgument(CustomTestCase):
    def _launch(self, mla, **stride):
        module = mock.Mock()
        staging = torch.empty(2 * PAGE, LAYERS, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        host = torch.empty(TOKENS, LAYERS, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        ptrs = torch.zeros(LAYERS, dtype=torch.uint64)
        src, dst = _pages([5, 1, 6]), _pages([3, 0, 4])
        with mock.patch.object(hicache, "_jit_hicache_staged_module", return_value=module):
            if mla:
                hicache.transfer_hicache_all_layer_mla_staged_lf_pf(
                    ptrs, src, dst, staging, host, page_size=PAGE, **stride
                )
                return module.launch_all_mla_lf_pf_staged.call_args_list
            hicache.transfer_hicache_all_layer_staged_lf_pf(
                ptrs, ptrs, src, dst, staging, staging, host, host, page_size=PAGE, **stride
            )
            return module.launch_all_lf_pf_staged.call_args_list

    def test_each_launch_gets_the_source_stride(self):
        for mla in (False, True):
            calls = self._launch(mla, src_stride_bytes=6 * ELEMENT)
            self.assertEqual(len(calls), 2)  # three pages through a two-page staging buffer
            self.assertEqual([call.args[-1] for call in calls], [6 * ELEMENT] * 2)

    def test_dense_rows_are_one_element_apart_by_default(self):
        for mla in (False, True):
            calls = self._launch(mla)
            self.assertEqual([call.args[-1] for call in calls], [ELEMENT] * 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the staged write-back kernel needs CUDA")
class TestStagedWriteBackKernelStridedSource(CustomTestCase):
    def _check(self, kinds, device_layers, stride):
        src_pages, dst_pages = [5, 1, 6, 9, 2], [3, 0, 4, 7, 8]
        src, dst = _pages(src_pages, device="cuda"), _pages(dst_pages)
        hosts = [torch.randn(TOKENS, LAYERS, HEADS, HEAD_DIM).to(torch.bfloat16).pin_memory() for _ in range(kinds)]
        before = [host.clone() for host in hosts]
        staging = [torch.empty(2 * PAGE, LAYERS, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                   for _ in range(kinds)]
        extra = {} if stride is None else {"src_stride_bytes": stride}
        if kinds == 2:
            hicache.transfer_hicache_all_layer_staged_lf_pf(
                _table(device_layers[0]), _table(device_layers[1]), src, dst, *staging, *hosts,
                page_size=PAGE, **extra,
            )
        else:
            hicache.transfer_hicache_all_layer_mla_staged_lf_pf(
                _table(device_layers[0]), src, dst, staging[0], hosts[0], page_size=PAGE, **extra
            )
        torch.cuda.synchronize()
        untouched = torch.ones(TOKENS, dtype=torch.bool)
        untouched[dst] = False
        for kind in range(kinds):
            for layer in range(LAYERS):
                self.assertTrue(torch.equal(hosts[kind][dst, layer], device_layers[kind][layer][src].cpu()))
            self.assertTrue(torch.equal(hosts[kind][untouched], before[kind][untouched]))

    def test_strided_rows_are_read_by_their_stride(self):
        for kinds in (2, 1):
            layers, stride = _interleaved(kinds, "cuda")
            self._check(kinds, layers, stride)

    def test_dense_rows_by_default(self):
        for kinds in (2, 1):
            layers = [[torch.randn(TOKENS, HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
                      for _ in range(kinds)]
            self._check(kinds, layers, None)

    def test_a_stride_below_the_row_is_refused(self):
        layers, _ = _interleaved(1, "cuda")
        with self.assertRaisesRegex(Exception, "source token stride"):
            self._check(1, layers, ELEMENT - 16)


if __name__ == "__main__":
    unittest.main()
