"""Unit tests for the staged page_first write-back over strided device rows.

The staged write-back gathers a chunk of pages from every device layer into a
device staging buffer, then copies it to the page_first host pool. Its source
rows lie src_stride_bytes apart: the element size for packed layers (the
default), more for per-layer views into a buffer that interleaves the layers.

CPU: the MHA and MLA host pools write strided rows of one stride back through
the staged kernel, which is replaced by an exact torch reference that steps
source rows by the stride it is given. CUDA: the kernel reads rows by it.
"""

import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from sglang.kernels.ops.kvcache import hicache
from sglang.srt.mem_cache.pool_host import mha as mha_host
from sglang.srt.mem_cache.pool_host import mla as mla_host
from sglang.test.ci.ci_register import (
    register_amd_ci,
    register_cpu_ci,
    register_cuda_ci,
)
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")
register_cuda_ci(est_time=20, stage="base-b-kernel-unit", runner_config="1-gpu-large")
register_amd_ci(est_time=20, suite="stage-b-test-1-gpu-small-amd")

LAYERS, PAGE, HEADS, HEAD_DIM, ROWS = 3, 4, 2, 64, 64
ELEMENT = HEADS * HEAD_DIM * 2  # bytes of one token's bf16 K (or V) row in one layer
KV_DIM = 576  # MLA latent + rope
DEVICE_ROWS = torch.tensor([4, 5, 6, 7, 20, 21, 22, 23])


class _StagedWriteBackKernel:
    """The staged write-back JIT module (staged_write_back.cuh) in torch: source
    rows read at the raw addresses of its pointer tables, stepped by the stride
    given (by the element size when none is given, as before the argument)."""

    def __init__(self, *device_tensors):
        self.storages = {}
        for tensor in device_tensors:
            storage = tensor.untyped_storage()
            self.storages[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8).set_(
                storage
            )

    def load(self, *, element_size, unroll, block_quota):
        self.element_size = element_size
        return self

    def _rows(self, address, stride, count):
        for begin, storage in self.storages.items():
            if begin <= address < begin + storage.numel():
                last = address - begin + (count - 1) * stride + self.element_size
                assert last <= storage.numel(), "rows past the end of a buffer"
                return storage.as_strided(
                    (count, self.element_size), (stride, 1), address - begin
                )
        raise AssertionError(f"address {address:#x} lies in no device buffer")

    def _write_back(self, dst, dst_indices, staging, pages, ptr_src, page_size, stride):
        tokens = (pages[:, None] + torch.arange(page_size)).flatten()
        staged = staging.view(torch.uint8)
        for layer, address in enumerate(ptr_src.tolist()):
            staged[:, layer] = self._rows(address, stride, int(tokens.max()) + 1)[
                tokens
            ]
        dst.view(torch.uint8)[dst_indices] = staged

    def launch_all_lf_pf_staged(
        self,
        k_dst,
        v_dst,
        idx,
        k_stg,
        v_stg,
        pages,
        k_src,
        v_src,
        page_size,
        stride=None,
    ):
        stride = self.element_size if stride is None else stride
        self._write_back(k_dst, idx, k_stg, pages, k_src, page_size, stride)
        self._write_back(v_dst, idx, v_stg, pages, v_src, page_size, stride)

    def launch_all_mla_lf_pf_staged(
        self, dst, idx, staging, pages, ptr_src, page_size, stride=None
    ):
        stride = self.element_size if stride is None else stride
        self._write_back(dst, idx, staging, pages, ptr_src, page_size, stride)


def _layer_views(kinds, row_shape, strided):
    if strided:  # one buffer of every layer's rows for each token
        whole = torch.randn(ROWS, LAYERS, kinds, *row_shape).to(torch.bfloat16)
        return [[whole[:, i, kind] for i in range(LAYERS)] for kind in range(kinds)]
    return [
        [torch.randn(ROWS, *row_shape).to(torch.bfloat16) for _ in range(LAYERS)]
        for _ in range(kinds)
    ]


def _table(views):
    return torch.tensor([view.data_ptr() for view in views], dtype=torch.uint64)


def _device_pool(**attrs):
    return SimpleNamespace(
        layer_num=LAYERS,
        start_layer=0,
        end_layer=LAYERS - 1,
        size=ROWS - PAGE,
        store_dtype=torch.bfloat16,
        device="cpu",
        layer_shard_enabled=False,
        **attrs,
    )


class TestStagedWriteBackStridedDeviceRows(CustomTestCase):
    def _write_back(self, host_cls, device_pool, device_views):
        kernel = _StagedWriteBackKernel(*device_views)
        with (
            mock.patch.object(mha_host, "_is_cuda", True),
            mock.patch.object(mla_host, "_is_cuda", True),
            mock.patch.object(hicache, "_jit_hicache_module"),
            mock.patch.object(hicache, "_jit_hicache_staged_module", kernel.load),
        ):
            host = host_cls(
                device_pool, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu"
            )
            host_rows = host.alloc(len(DEVICE_ROWS))
            host.backup_from_device_all_layer(
                device_pool, host_rows, DEVICE_ROWS, "kernel"
            )
        # The staged kernel serves packed rows and strided rows of one stride.
        self.assertTrue(
            host.can_use_write_back_jit,
            "the staged write-back does not serve these rows",
        )
        return host, host_rows

    def test_mha_rows_are_read_by_their_stride(self):
        for strided in (True, False):
            with self.subTest(strided=strided):
                k, v = _layer_views(2, (HEADS, HEAD_DIM), strided)
                device_pool = _device_pool(
                    head_num=HEADS,
                    head_dim=HEAD_DIM,
                    k_buffer=k,
                    v_buffer=v,
                    k_data_ptrs=_table(k),
                    v_data_ptrs=_table(v),
                )
                host, host_rows = self._write_back(
                    mha_host.MHATokenToKVPoolHost, device_pool, k + v
                )
                for layer in range(LAYERS):
                    for host_buffer, views in ((host.k_buffer, k), (host.v_buffer, v)):
                        torch.testing.assert_close(
                            host_buffer[host_rows, layer],
                            views[layer][DEVICE_ROWS],
                            rtol=0,
                            atol=0,
                        )

    def test_mla_rows_are_read_by_their_stride(self):
        for strided in (True, False):
            with self.subTest(strided=strided):
                (kv,) = _layer_views(1, (1, KV_DIM), strided)
                device_pool = _device_pool(
                    kv_lora_rank=KV_DIM - 64,
                    qk_rope_head_dim=64,
                    kv_buffer=kv,
                    data_ptrs=_table(kv),
                )
                host, host_rows = self._write_back(
                    mla_host.MLATokenToKVPoolHost, device_pool, kv
                )
                for layer in range(LAYERS):
                    torch.testing.assert_close(
                        host.kv_buffer[host_rows, layer],
                        kv[layer][DEVICE_ROWS],
                        rtol=0,
                        atol=0,
                    )


def _pages(pages, device="cpu"):
    return torch.tensor(
        [page * PAGE + token for page in pages for token in range(PAGE)], device=device
    )


def _cuda_table(views):
    return torch.tensor(
        [view.data_ptr() for view in views], dtype=torch.uint64, device="cuda"
    )


@unittest.skipUnless(
    torch.cuda.is_available(), "the staged write-back kernel needs CUDA"
)
class TestStagedWriteBackKernelStridedSource(CustomTestCase):
    def _check(self, kinds, device_layers, stride):
        src, dst = _pages([5, 1, 6, 9, 2], device="cuda"), _pages([3, 0, 4, 7, 8])
        shape = (ROWS, LAYERS, HEADS, HEAD_DIM)
        hosts = [
            torch.randn(shape).to(torch.bfloat16).pin_memory() for _ in range(kinds)
        ]
        before = [host.clone() for host in hosts]
        staging = [
            torch.empty(
                2 * PAGE, LAYERS, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"
            )
            for _ in range(kinds)
        ]
        extra = {} if stride is None else {"src_stride_bytes": stride}
        if kinds == 2:
            hicache.transfer_hicache_all_layer_staged_lf_pf(
                _cuda_table(device_layers[0]),
                _cuda_table(device_layers[1]),
                src,
                dst,
                *staging,
                *hosts,
                page_size=PAGE,
                **extra,
            )
        else:
            hicache.transfer_hicache_all_layer_mla_staged_lf_pf(
                _cuda_table(device_layers[0]),
                src,
                dst,
                staging[0],
                hosts[0],
                page_size=PAGE,
                **extra,
            )
        torch.cuda.synchronize()
        untouched = torch.ones(ROWS, dtype=torch.bool)
        untouched[dst] = False
        for kind in range(kinds):
            for layer in range(LAYERS):
                torch.testing.assert_close(
                    hosts[kind][dst, layer],
                    device_layers[kind][layer][src].cpu(),
                    rtol=0,
                    atol=0,
                )
            torch.testing.assert_close(
                hosts[kind][untouched], before[kind][untouched], rtol=0, atol=0
            )

    def _strided(self, kinds):
        whole = torch.randn(ROWS, LAYERS, kinds, HEADS, HEAD_DIM, device="cuda")
        whole = whole.to(torch.bfloat16)
        layers = [[whole[:, i, kind] for i in range(LAYERS)] for kind in range(kinds)]
        return layers, LAYERS * kinds * ELEMENT

    def test_strided_rows_are_read_by_their_stride(self):
        for kinds in (2, 1):
            with self.subTest(kinds=kinds):
                self._check(kinds, *self._strided(kinds))

    def test_packed_rows_by_default(self):
        for kinds in (2, 1):
            with self.subTest(kinds=kinds):
                layers = [
                    [
                        torch.randn(ROWS, HEADS, HEAD_DIM, device="cuda").to(
                            torch.bfloat16
                        )
                        for _ in range(LAYERS)
                    ]
                    for _ in range(kinds)
                ]
                self._check(kinds, layers, None)

    def test_a_stride_below_the_row_is_refused(self):
        layers, _ = self._strided(1)
        with self.assertRaisesRegex(Exception, "source token stride"):
            self._check(1, layers, ELEMENT - 16)


if __name__ == "__main__":
    unittest.main()
