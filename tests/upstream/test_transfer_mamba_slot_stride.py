"""Unit tests for the Mamba state transfer kernels' device slot stride.

transfer_kv_mamba_lf_pf (backup) and transfer_kv_mamba_pf_lf (load) step a device
layer's slots by `src_stride_bytes` / `dst_stride_bytes`: the item size for dense
layers (the default), more where each slot's states sit in one padded cell with every
layer's. The wrappers pass the stride (CPU test, the JIT module mocked); the kernels
copy by it, touch no other byte, and copy items of any multiple of 16 bytes, also
ones that do not fill the load kernel's batch of reads in flight (CUDA test).
"""

import unittest
from unittest import mock

import pytest
import torch

from sglang.kernels.ops.mamba import transfer_mamba
from sglang.test.ci.ci_register import register_cpu_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")
register_cuda_ci(est_time=20, stage="base-b-kernel-unit", runner_config="1-gpu-large")

LAYERS, SLOTS = 3, 8


class TestTransferMambaStrideArgument(CustomTestCase):
    def test_wrappers_pass_the_stride_or_the_item_size(self):
        module = mock.Mock()
        idx = torch.arange(2)
        with mock.patch.object(transfer_mamba, "_jit_transfer_mamba_module", return_value=module):
            transfer_mamba.transfer_kv_mamba_pf_lf(None, None, idx, idx, 1, 64, 192, dst_stride_bytes=320)
            transfer_mamba.transfer_kv_mamba_pf_lf(None, None, idx, idx, 1, 64, 192)
            transfer_mamba.transfer_kv_mamba_lf_pf(None, None, idx, idx, 64, 192, 3, src_stride_bytes=320)
            transfer_mamba.transfer_kv_mamba_lf_pf(None, None, idx, idx, 64, 192, 3)
        self.assertEqual([c.args[-1] for c in module.transfer_kv_mamba_pf_lf.call_args_list], [320, 64])
        self.assertEqual([c.args[-1] for c in module.transfer_kv_mamba_lf_pf.call_args_list], [320, 64])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Mamba transfer kernels need CUDA")
class TestTransferMambaKernelSlotStride(CustomTestCase):
    def _cells(self, item, padding):
        """Each slot's states for every layer in one cell of LAYERS * item + padding bytes."""
        cell = torch.randint(0, 256, (SLOTS, LAYERS * item + padding), dtype=torch.uint8, device="cuda")
        return cell, [cell[:, layer * item : (layer + 1) * item] for layer in range(LAYERS)]

    def _round_trip(self, item, padding):
        cell, layers = self._cells(item, padding)
        original = cell.clone()
        host = torch.randint(0, 256, (SLOTS, LAYERS * item), dtype=torch.uint8).pin_memory()
        host_before = host.clone()
        stride = LAYERS * item + padding
        ptrs = torch.tensor([layer.data_ptr() for layer in layers], dtype=torch.uint64, device="cuda")
        device_slots = torch.tensor([1, 6], device="cuda")
        host_slots = torch.tensor([2, 5], device="cuda")
        transfer_mamba.transfer_kv_mamba_lf_pf(
            ptrs, host, device_slots, host_slots, item, LAYERS * item, LAYERS, src_stride_bytes=stride
        )
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            got = host.view(SLOTS, LAYERS, item)[[2, 5], layer]
            self.assertTrue(torch.equal(got, layers[layer][[1, 6]].cpu()))
        others = [s for s in range(SLOTS) if s not in (2, 5)]
        self.assertTrue(torch.equal(host[others], host_before[others]))
        targets = torch.tensor([3, 7], device="cuda")
        for layer in range(LAYERS):
            transfer_mamba.transfer_kv_mamba_pf_lf(
                host, layers[layer], host_slots, targets, layer, item, LAYERS * item, dst_stride_bytes=stride
            )
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            self.assertTrue(torch.equal(layers[layer][[3, 7]], original[[1, 6], layer * item : (layer + 1) * item]))
        untouched = [s for s in range(SLOTS) if s not in (3, 7)]
        self.assertTrue(torch.equal(cell[untouched], original[untouched]))
        self.assertTrue(torch.equal(cell[[3, 7], LAYERS * item :], original[[3, 7], LAYERS * item :]))

    def test_strided_slots_round_trip(self):
        # items from one 16-byte read per thread to several batches of reads in flight
        for item in (16, 48, 4096, 16384 + 16, 131072 + 48):
            self._round_trip(item, padding=32)

    def test_dense_slots_by_default(self):
        cell = torch.randint(0, 256, (SLOTS, 512), dtype=torch.uint8, device="cuda")
        host = torch.zeros(SLOTS, 512, dtype=torch.uint8).pin_memory()
        ptrs = torch.tensor([cell.data_ptr()], dtype=torch.uint64, device="cuda")
        idx = torch.tensor([4], device="cuda")
        transfer_mamba.transfer_kv_mamba_lf_pf(ptrs, host, idx, idx, 512, 512, 1)
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(host[4], cell[4].cpu()))

    def test_a_stride_below_the_item_is_refused(self):
        _, layers = self._cells(64, 0)
        ptrs = torch.tensor([layer.data_ptr() for layer in layers], dtype=torch.uint64, device="cuda")
        host = torch.zeros(SLOTS, LAYERS * 64, dtype=torch.uint8).pin_memory()
        idx = torch.tensor([1], device="cuda")
        with self.assertRaisesRegex(Exception, "device slot stride"):
            transfer_mamba.transfer_kv_mamba_lf_pf(ptrs, host, idx, idx, 64, LAYERS * 64, LAYERS, src_stride_bytes=48)


if __name__ == "__main__":
    unittest.main()
