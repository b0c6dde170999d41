"""Unit tests for sharing --hicache-size between a hybrid model's device pools.

The split weighs each pool by get_logical_kv_size_bytes(): the KV of the size +
page_size tokens it serves. For SGLang's own pools that is get_kv_size_bytes(); a
pool whose per-layer buffers hold more rows than it serves (one that reserves
virtual memory up front) counts only the rows it serves.
"""

import unittest
from types import SimpleNamespace

import torch

from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _split_hicache_size
from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool, MLATokenToKVPool
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

PAGE = 64


def _mha_pool(rows, size, layers=4, heads=2, head_dim=128):
    pool = MHATokenToKVPool.__new__(MHATokenToKVPool)
    pool.size, pool.page_size = size, PAGE
    pool.k_buffer = [torch.empty(rows, heads, head_dim, dtype=torch.bfloat16, device="meta") for _ in range(layers)]
    pool.v_buffer = [torch.empty(rows, heads, head_dim, dtype=torch.bfloat16, device="meta") for _ in range(layers)]
    return pool


def _mla_pool(rows, size, layers=4, kv_dim=576):
    pool = MLATokenToKVPool.__new__(MLATokenToKVPool)
    pool.size, pool.page_size = size, PAGE
    pool.kv_buffer = [torch.empty(rows, 1, kv_dim, dtype=torch.bfloat16, device="meta") for _ in range(layers)]
    return pool


def _mamba_pool(state_bytes):
    pool = MambaPool.__new__(MambaPool)
    pool.mamba_cache = SimpleNamespace(mem_usage_bytes=lambda: state_bytes)
    return pool


class TestLogicalKVSize(CustomTestCase):
    def test_pools_sized_for_their_tokens_count_their_buffers(self):
        for pool in (_mha_pool(1000 + PAGE, 1000), _mla_pool(1000 + PAGE, 1000)):
            size = pool.get_kv_size_bytes()
            self.assertEqual(pool.get_logical_kv_size_bytes(), sum(size) if isinstance(size, tuple) else size)

    def test_oversized_buffers_count_only_the_rows_served(self):
        served, reserved = _mha_pool(1000 + PAGE, 1000), _mha_pool(100_000, 1000)
        self.assertEqual(reserved.get_logical_kv_size_bytes(), served.get_logical_kv_size_bytes())
        served, reserved = _mla_pool(1000 + PAGE, 1000), _mla_pool(100_000, 1000)
        self.assertEqual(reserved.get_logical_kv_size_bytes(), served.get_logical_kv_size_bytes())

    def test_a_mamba_pool_counts_its_state(self):
        self.assertEqual(_mamba_pool(12345).get_logical_kv_size_bytes(), 12345)

    def test_a_pool_without_layers_holds_nothing(self):
        self.assertEqual(_mha_pool(1000, 1000, layers=0).get_logical_kv_size_bytes(), 0)


class TestSplitHiCacheSize(CustomTestCase):
    def test_oversized_buffers_take_no_more_than_their_share(self):
        mamba = _mamba_pool(3 * 10**9)
        native = _split_hicache_size(14, (_mha_pool(200_000 + PAGE, 200_000), mamba))
        reserved = _split_hicache_size(14, (_mha_pool(4_000_000, 200_000), mamba))
        self.assertEqual(native, reserved)
        self.assertAlmostEqual(sum(reserved), 14)

    def test_shares_follow_the_kv_each_pool_serves(self):
        full, window = _mha_pool(300_000 + PAGE, 300_000), _mha_pool(40_000 + PAGE, 40_000)
        shares = _split_hicache_size(20, (full, window))
        self.assertAlmostEqual(shares[0] / shares[1], (300_000 + PAGE) / (40_000 + PAGE))


if __name__ == "__main__":
    unittest.main()
