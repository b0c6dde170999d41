"""Unit tests for the JIT Mamba state transfer kernels (transfer_mamba.cuh).

transfer_kv_mamba_lf_pf backs up every layer's states of the given device
slots to page_first host memory; transfer_kv_mamba_pf_lf loads one layer's
back. Both copy bit-exactly and touch no other byte:

- loads of items of any multiple of 16 bytes, also ones that do not fill the
  load kernel's batch of reads in flight or that span several batches;
- device slots stepped by a slot stride (src_stride_bytes on backup,
  dst_stride_bytes on load): the item size for packed slots (the default),
  more where each slot's states for every layer sit in one cell.

The host pool's side (MambaPoolHost passing each view's stride) is covered
on CPU in test_mem_pool_host.py.
"""

import unittest

import torch

from sglang.kernels.ops.mamba import transfer_mamba
from sglang.test.ci.ci_register import register_amd_ci, register_cuda_ci
from sglang.test.test_utils import CustomTestCase

register_cuda_ci(est_time=20, stage="base-b-kernel-unit", runner_config="1-gpu-large")
register_amd_ci(est_time=20, suite="stage-b-test-1-gpu-small-amd")

LAYERS, SLOTS = 3, 8
# One 16-byte read per thread up to several batches of reads in flight
# (1024 threads x 16 B x 8 reads = 128 KiB a batch), with remainders.
ITEM_SIZES = (16, 48, 4096, 16384 + 16, 131072 - 16, 131072, 131072 + 48, 262144 + 16)


def _bytes(*shape, device="cuda"):
    return torch.randint(0, 256, shape, dtype=torch.uint8, device=device)


@unittest.skipUnless(torch.cuda.is_available(), "the Mamba transfer kernels need CUDA")
class TestTransferMambaKernelExactness(CustomTestCase):
    def test_loads_of_any_item_size_are_exact(self):
        for item in ITEM_SIZES:
            with self.subTest(item=item):
                device = _bytes(SLOTS, item)
                before = device.clone()
                host = _bytes(SLOTS, LAYERS * item, device="cpu").pin_memory()
                host_slots = torch.tensor([2, 5], device="cuda")
                device_slots = torch.tensor([3, 7], device="cuda")
                transfer_mamba.transfer_kv_mamba_pf_lf(
                    host, device, host_slots, device_slots, 1, item, LAYERS * item
                )
                torch.cuda.synchronize()
                expected = before.clone()
                expected[[3, 7]] = host[[2, 5], item : 2 * item].cuda()
                torch.testing.assert_close(device, expected, rtol=0, atol=0)

    def test_backups_of_any_item_size_are_exact(self):
        for item in ITEM_SIZES:
            with self.subTest(item=item):
                layers = _bytes(LAYERS, SLOTS, item)
                ptrs = torch.tensor(
                    [layer.data_ptr() for layer in layers],
                    dtype=torch.uint64,
                    device="cuda",
                )
                host = _bytes(SLOTS, LAYERS * item, device="cpu").pin_memory()
                expected = host.clone()
                device_slots = torch.tensor([1, 6], device="cuda")
                host_slots = torch.tensor([2, 5], device="cuda")
                transfer_mamba.transfer_kv_mamba_lf_pf(
                    ptrs, host, device_slots, host_slots, item, LAYERS * item, LAYERS
                )
                torch.cuda.synchronize()
                expected.view(SLOTS, LAYERS, item)[[2, 5]] = (
                    layers[:, [1, 6]].transpose(0, 1).cpu()
                )
                torch.testing.assert_close(host, expected, rtol=0, atol=0)


@unittest.skipUnless(torch.cuda.is_available(), "the Mamba transfer kernels need CUDA")
class TestTransferMambaKernelSlotStride(CustomTestCase):
    def _round_trip(self, item, padding):
        # Each slot's states for every layer in one cell of LAYERS * item +
        # padding bytes: per-layer views whose slots lie one cell apart.
        stride = LAYERS * item + padding
        cell = _bytes(SLOTS, stride)
        original = cell.clone()
        layers = [cell[:, i * item : (i + 1) * item] for i in range(LAYERS)]
        ptrs = torch.tensor(
            [layer.data_ptr() for layer in layers], dtype=torch.uint64, device="cuda"
        )
        host = _bytes(SLOTS, LAYERS * item, device="cpu").pin_memory()
        host_before = host.clone()
        device_slots = torch.tensor([1, 6], device="cuda")
        host_slots = torch.tensor([2, 5], device="cuda")
        transfer_mamba.transfer_kv_mamba_lf_pf(
            ptrs,
            host,
            device_slots,
            host_slots,
            item,
            LAYERS * item,
            LAYERS,
            src_stride_bytes=stride,
        )
        torch.cuda.synchronize()
        expected = host_before.clone()
        expected[[2, 5]] = original[[1, 6], : LAYERS * item].cpu()
        torch.testing.assert_close(host, expected, rtol=0, atol=0)

        targets = torch.tensor([3, 7], device="cuda")
        for layer in range(LAYERS):
            transfer_mamba.transfer_kv_mamba_pf_lf(
                host,
                layers[layer],
                host_slots,
                targets,
                layer,
                item,
                LAYERS * item,
                dst_stride_bytes=stride,
            )
        torch.cuda.synchronize()
        expected = original.clone()
        expected[[3, 7], : LAYERS * item] = original[[1, 6], : LAYERS * item]
        torch.testing.assert_close(cell, expected, rtol=0, atol=0)

    def test_strided_slots_round_trip(self):
        for item in ITEM_SIZES:
            with self.subTest(item=item):
                self._round_trip(item, padding=32)

    def test_a_stride_below_the_item_is_refused(self):
        layers = _bytes(LAYERS, SLOTS, 64)
        ptrs = torch.tensor(
            [layer.data_ptr() for layer in layers], dtype=torch.uint64, device="cuda"
        )
        host = _bytes(SLOTS, LAYERS * 64, device="cpu").pin_memory()
        slots = torch.tensor([1], device="cuda")
        with self.assertRaisesRegex(Exception, "device slot stride"):
            transfer_mamba.transfer_kv_mamba_lf_pf(
                ptrs, host, slots, slots, 64, LAYERS * 64, LAYERS, src_stride_bytes=48
            )


if __name__ == "__main__":
    unittest.main()
