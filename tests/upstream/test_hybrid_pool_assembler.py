"""Unit tests for sharing --hicache-size between a hybrid model's device pools.

Additions to SGLang's
test/registered/unit/mem_cache/test_hybrid_pool_assembler.py.

The split weighs each pool by the KV of the size + page_size tokens it serves.
SGLang's pools hold exactly those rows, so their shares do not change; a pool
that reserves virtual memory up front gives each layer a buffer of far more
rows, which must not take the other pools' share. A pool that reports only
get_kv_size_bytes() is weighed by it, as before.
"""

import unittest
from types import SimpleNamespace

import torch

from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
    _split_hicache_size,
)
from sglang.srt.mem_cache.memory_pool import (
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=1, suite="base-a-test-cpu")

PAGE = 64


def _mha_pool(rows, size, layers=4, heads=2, head_dim=128):
    pool = MHATokenToKVPool.__new__(MHATokenToKVPool)
    pool.size, pool.page_size = size, PAGE
    shape = (rows, heads, head_dim)
    pool.k_buffer = [torch.empty(shape, dtype=torch.bfloat16, device="meta")] * layers
    pool.v_buffer = [torch.empty(shape, dtype=torch.bfloat16, device="meta")] * layers
    return pool


def _mla_pool(rows, size, layers=4, kv_dim=576):
    pool = MLATokenToKVPool.__new__(MLATokenToKVPool)
    pool.size, pool.page_size = size, PAGE
    shape = (rows, 1, kv_dim)
    pool.kv_buffer = [torch.empty(shape, dtype=torch.bfloat16, device="meta")] * layers
    return pool


def _mamba_pool(state_bytes):
    pool = MambaPool.__new__(MambaPool)
    pool.mamba_cache = SimpleNamespace(mem_usage_bytes=lambda: state_bytes)
    return pool


class _KVBytesOnlyPool:
    """A duck-typed pool, as SGLang's own split tests pass."""

    def __init__(self, kv_bytes):
        self.kv_bytes = kv_bytes

    def get_kv_size_bytes(self):
        return self.kv_bytes


class TestSplitHicacheSizeByServedKV(CustomTestCase):
    def test_reserved_rows_take_no_share(self):
        mamba = _mamba_pool(3 * 10**9)
        for make_pool in (_mha_pool, _mla_pool):
            with self.subTest(make_pool.__name__):
                sized = _split_hicache_size(14, (make_pool(8_064, 8_000), mamba))
                reserved = _split_hicache_size(14, (make_pool(1_000_000, 8_000), mamba))
                self.assertEqual(reserved, sized)

    def test_pools_sized_for_their_tokens_split_by_their_buffers(self):
        full, window = (
            _mha_pool(300_000 + PAGE, 300_000),
            _mla_pool(40_000 + PAGE, 40_000),
        )
        mamba = _mamba_pool(10**9)
        shares = _split_hicache_size(20, (full, window, mamba))
        by_buffers = _split_hicache_size(
            20,
            tuple(
                _KVBytesOnlyPool(pool.get_kv_size_bytes())
                for pool in (full, window, mamba)
            ),
        )
        for share, expected in zip(shares, by_buffers, strict=True):
            self.assertAlmostEqual(share, expected)

    def test_pools_reporting_only_their_buffer_bytes(self):
        # scalar and (k, v) tuple return shapes both supported
        shares = _split_hicache_size(
            100,
            (_KVBytesOnlyPool(75 * 10**9), _KVBytesOnlyPool((15 * 10**9, 10 * 10**9))),
        )
        self.assertEqual(shares, (75.0, 25.0))


if __name__ == "__main__":
    unittest.main()
