"""Configurations no stride-aware copy serves are refused when the host pool is built.

Host-pool constructors are where every builder passes (the hybrid assembler, the legacy
HiRadixCache, the PD decode offload manager), so a refusal here is a refusal at startup.
On SGLang 0.5.20 without the series these pools are built without complaint.
"""
from __future__ import annotations

import pytest

from tests.support.kvcached_views import mha_pool, mla_pool

PAGE = 16


def strided_mha(**kw):
    return mha_pool("kvcached-contiguous", size=8 * PAGE, page_size=PAGE, layers=2, heads=2, head_dim=64, **kw)


def strided_mla():
    return mla_pool("kvcached-contiguous", size=8 * PAGE, page_size=PAGE, layers=2, kv_lora_rank=96,
                    qk_rope_head_dim=32)


def test_mha_page_head(host_modules):
    with pytest.raises(ValueError, match="page_head"):
        host_modules.mha.MHATokenToKVPoolHost(strided_mha(), 2.0, 0, PAGE, "page_head", pin_memory=False,
                                              device="cpu")


def test_mha_packed_mtp_drafts(host_modules):
    draft = mha_pool("kvcached-contiguous", size=8 * PAGE, page_size=PAGE, layers=1, heads=2, head_dim=64)
    with pytest.raises(ValueError, match="MTP draft"):
        host_modules.mha.MHATokenToKVPoolHost(strided_mha(), 2.0, 0, PAGE, "layer_first", pin_memory=False,
                                              device="cpu", mtp_draft_device_pools=(draft,))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mha_without_the_jit_kernel(host_modules, monkeypatch, layout):
    monkeypatch.setattr(host_modules.mha, "can_use_hicache_jit_kernel", lambda **kw: False)
    with pytest.raises(ValueError, match="page_first_direct"):
        host_modules.mha.MHATokenToKVPoolHost(strided_mha(), 2.0, 0, PAGE, layout, pin_memory=False, device="cpu")


def test_mha_page_first_without_staged_write_back(host_modules, monkeypatch):
    monkeypatch.setattr(host_modules.mha, "can_use_write_back_jit_kernel", lambda **kw: False)
    with pytest.raises(ValueError, match="staged write-back"):
        host_modules.mha.MHATokenToKVPoolHost(strided_mha(), 2.0, 0, PAGE, "page_first", pin_memory=False,
                                              device="cpu")


def test_mla_decode_context_parallel(host_modules):
    with pytest.raises(ValueError, match="dcp-size"):
        host_modules.mla.MLATokenToKVPoolHost(strided_mla(), 2.0, 0, PAGE, "layer_first", pin_memory=False,
                                              device="cpu", dcp_size=2, dcp_rank=0)


def test_mla_packed_mtp_drafts(host_modules):
    with pytest.raises(ValueError, match="MTP draft"):
        host_modules.mla.MLATokenToKVPoolHost(strided_mla(), 2.0, 0, PAGE, "layer_first", pin_memory=False,
                                              device="cpu", mtp_draft_device_pools=(strided_mla(),))


def test_mla_layer_sharded(host_modules):
    pool = strided_mla()
    pool.layer_shard_enabled = True
    pool.layer_shard_size = 1
    pool._owned_local_layer_range = lambda: (0, pool.layer_num)
    with pytest.raises(ValueError, match="layer-sharded"):
        host_modules.mla.MLATokenToKVPoolHost(pool, 2.0, 0, PAGE, "layer_first", pin_memory=False, device="cpu")


def test_dense_pools_are_not_refused(host_modules):
    """The refusals are for strided views only: SGLang's own pools keep every option."""
    dense = mha_pool("native", size=8 * PAGE, page_size=PAGE, layers=2, heads=2, head_dim=64)
    host = host_modules.mha.MHATokenToKVPoolHost(dense, 2.0, 0, PAGE, "page_head", pin_memory=False, device="cpu")
    assert not host.device_views_strided
