"""Configurations no stride-aware copy serves are refused when the host pool is built.

Host-pool constructors are where every builder passes (the hybrid assembler, the legacy
HiRadixCache, the PD decode offload manager), so a refusal here is a refusal at startup;
it comes before any host memory is allocated or pinned (``refused``): nothing to unpin or
leak. On SGLang 0.5.20 without the series these pools are built without complaint.
"""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from tests.support.kvcached_views import PerLayerMambaState, mamba_pool, mha_pool, mla_pool

PAGE = 16
NO_JIT = "only the JIT HiCache kernels copy.*disable --enable-hierarchical-cache"
MAMBA = dict(slots=4, layers=2, conv_shapes=[(96, 3)], temporal_shape=(2, 16, 16), page_bytes=64 << 10)


def strided_mha(layers=2):
    return mha_pool("kvcached-contiguous", size=8 * PAGE, page_size=PAGE, layers=layers, heads=2, head_dim=64)


def strided_mla(layers=2):
    return mla_pool("kvcached-contiguous", size=8 * PAGE, page_size=PAGE, layers=layers, kv_lora_rank=96,
                    qk_rope_head_dim=32)


def dense_mha():
    return mha_pool("native", size=8 * PAGE, page_size=PAGE, layers=2, heads=2, head_dim=64)


@pytest.fixture
def host(host_modules):
    """build(kind, pool, layout, page=PAGE, **kw): the host pool of ``kind`` (mha, asymmetric, mla,
    mamba) over ``pool``, unpinned, on the CPU."""
    m = host_modules

    def build(kind, pool, layout, page=PAGE, **kw):
        if kind == "mamba":
            return m.mamba.MambaPoolHost(pool, 2.0, 0, pin_memory=False, device="cpu", layout=layout)
        cls = {"mha": m.mha.MHATokenToKVPoolHost, "asymmetric": m.mha.AsymmetricMHATokenToKVPoolHost,
               "mla": m.mla.MLATokenToKVPoolHost}[kind]
        return cls(pool, 2.0, 0, page, layout, pin_memory=False, device="cpu", **kw)

    return build


@pytest.fixture
def refused(host_modules, monkeypatch):
    """refused(match): pytest.raises(ValueError, match=match), and nothing allocated or pinned meanwhile."""
    allocated = []
    for module in (host_modules.mha, host_modules.mla, host_modules.mamba):
        funcs = module.ALLOC_MEMORY_FUNCS
        monkeypatch.setattr(module, "ALLOC_MEMORY_FUNCS",
                            type(funcs)(lambda: lambda *a, **kw: allocated.append(a) or torch.empty(0)))

    @contextmanager
    def check(match):
        with pytest.raises(ValueError, match=match):
            yield
        assert allocated == []

    return check


def test_mha_page_head(host, refused):
    with refused("page_head"):
        host("mha", strided_mha(), "page_head")


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mha_without_the_jit_kernel(host_modules, host, refused, monkeypatch, layout):
    monkeypatch.setattr(host_modules.mha, "can_use_hicache_jit_kernel", lambda **kw: False)
    with refused(NO_JIT):
        host("mha", strided_mha(), layout)


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_page_first_direct(host, refused, kind):
    """sglang-kernel's page_first_direct copies take page_size * stride(0) bytes per layer
    (harness/emulation/aot.py): right only for dense views."""
    with refused("page_first_direct cannot copy; use --hicache-mem-layout page_first"):
        host(kind, strided_mha() if kind == "mha" else strided_mla(), "page_first_direct")


def test_mamba_page_first_direct(host, refused):
    for layout in ("kvcached-contiguous", "kvcached-per-layer"):  # strided in both
        with refused("page_first_direct cannot copy; use .*page_first with --hicache-io-backend kernel"):
            host("mamba", mamba_pool(layout, **MAMBA), "page_first_direct")


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mha_asymmetric_heads(host, refused, layout):
    """head_dim != v_head_dim (MiMo-V2): its copies all run sglang-kernel's kernels, which
    address device rows as packed, so strided views are refused in every layout (its own
    layouts, and layer_first, which it does not serve at all). The pool's head dims are
    equal: only the class (SGLang picks it for unequal ones) matters."""
    with refused("head_dim != v_head_dim cannot copy"):
        host("asymmetric", strided_mha(), layout)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("rank", [0, 1])
def test_mla_decode_context_parallel_is_served(host, layout, rank):
    """--dcp-size 2: a host page holds page_size * dcp_size widened slots, of which this
    rank stores the rows s // dcp_size of its slots s % dcp_size == rank. SGLang
    translates the indices to physical rows before any copy, so the strided copies
    serve DCP as they are; kvcached builds DCP pools at physical size and page."""
    from tests.support.roundtrip import as_bytes, poison, random_rows

    dcp, layers = 2, 2
    pool = strided_mla()
    generator = torch.Generator().manual_seed(rank)
    for view in pool.kv_buffer:
        view[: 8 * PAGE] = random_rows(view, 8 * PAGE, generator)
    hp = host("mla", pool, layout, page=PAGE * dcp, dcp_size=dcp, dcp_rank=rank)
    poison(hp.kv_buffer, generator)
    wide = lambda page: page * PAGE * dcp + torch.arange(PAGE * dcp)  # one widened page's slots
    before = [as_bytes(view[: 8 * PAGE]).clone() for view in pool.kv_buffer]
    hp.backup_from_device_all_layer(pool, wide(5), wide(3), "kernel")
    for layer in range(layers):  # host page 5 holds device page 3's physical rows
        assert torch.equal(as_bytes(hp.data_refs[layer][5 * PAGE: 6 * PAGE]), before[layer][3 * PAGE: 4 * PAGE])
    for layer in range(layers):
        hp.load_to_device_per_layer(pool, wide(5), wide(6), layer, "kernel")
    for layer, view in enumerate(pool.kv_buffer):
        expected = before[layer].clone()
        expected[6 * PAGE: 7 * PAGE] = before[layer][3 * PAGE: 4 * PAGE]
        assert torch.equal(as_bytes(view[: 8 * PAGE]), expected)


def test_mla_layer_sharded_is_served(host):
    """Layer-sharded pools back up layer by layer through the one-layer kernel, which
    reads each view's stride: the same path as for dense views, so nothing is refused."""
    from tests.support.roundtrip import RoundTrip, fill_random, mla_families, pages_to_rows, poison

    pool = strided_mla()
    pool.layer_shard_enabled = True
    pool.layer_shard_size = 1
    pool._owned_local_layer_range = lambda: (0, pool.layer_num)
    hp = host("mla", pool, "layer_first")
    generator = torch.Generator().manual_seed(1)
    families = mla_families(pool, hp)
    fill_random(families, pages_to_rows(range(1, 8), PAGE), generator)
    poison(hp.kv_buffer, generator)
    RoundTrip(families, range(1, 8), range(1, hp.size // PAGE), PAGE, pool.layer_num,
              backup=lambda h, d: hp.backup_from_device_all_layer(pool, h, d, "kernel"),
              load=lambda h, d, l: hp.load_to_device_per_layer(pool, h, d, l, "kernel"),
              seed=2, max_pages=3, device="cpu").run(6)


def test_dense_pools_are_not_refused(host):
    """The refusals are for strided views only: SGLang's own pools keep every option."""
    hp = host("mha", dense_mha(), "page_head")
    assert hp.device_rows_packed and hp.device_row_stride_bytes == hp.token_stride_size


def test_mla_rows_the_jit_kernel_cannot_take(host, refused):
    """DeepSeek's MLA rows in fp8 are 576 bytes: the JIT HiCache kernel (its real gate,
    over the emulated build) takes multiples of 128 only, and sglang-kernel's fallback
    kernels address rows as if each layer were dense."""
    pool = mla_pool("kvcached-contiguous", size=8 * PAGE, page_size=PAGE, layers=2, kv_lora_rank=512,
                    qk_rope_head_dim=64, dtype=torch.float8_e4m3fn)
    with refused(NO_JIT):
        host("mla", pool, "page_first")


def _mixed_mamba_pool(mix):
    """Two Mamba layers whose temporal (or conv) views do not share a slot stride: layer 0
    from kvcached's contiguous layout (a cell per layer apart), layer 1 from its per-layer
    layout (one cell apart)."""
    from sglang.srt.mem_cache.memory_pool import MambaPool

    contiguous, per_layer = (mamba_pool(layout, **MAMBA).mamba_cache
                             for layout in ("kvcached-contiguous", "kvcached-per-layer"))
    first, second, apart = contiguous.at_layer_idx(0), contiguous.at_layer_idx(1), per_layer.at_layer_idx(1)
    temporal = [first.temporal, (apart if mix == "temporal" else second).temporal]
    conv = [[first.conv[0], (apart if mix == "conv" else second).conv[0]]]
    pool = SimpleNamespace(mamba_cache=PerLayerMambaState(MambaPool.State, conv, temporal), num_mamba_layers=2,
                           size=4, device="cpu")
    pool.mamba2_layer_cache = pool.mamba_cache.at_layer_idx
    return pool


@pytest.mark.parametrize("kind,names", [("mha", "KV rows of layer 0: its views"), ("mla", "KV rows"),
                                        ("mamba-temporal", "Mamba state: its per-layer views"),
                                        ("mamba-conv", "Mamba state: its per-layer views")])
def test_views_without_one_row_stride_are_refused_by_name(host, refused, kind, names):
    """A pool whose views share no row stride cannot be copied by any kernel: the refusal
    says which buffers, so that the operator knows what to change."""
    if kind == "mha":
        pool = strided_mha()
        pool.v_buffer = strided_mha(layers=3).v_buffer[:2]  # records of three layers: V rows further apart
    elif kind == "mla":
        pool = strided_mla()
        pool.kv_buffer = [pool.kv_buffer[0], strided_mla(layers=3).kv_buffer[1]]
    else:
        pool = _mixed_mamba_pool(kind.split("-")[1])
    with refused(f"HiCache cannot copy the device {names}.* do not share one|"
                 f"MLA device pools' rows are strided by different"):
        host(kind.split("-")[0], pool, "page_first" if kind.startswith("mamba") else "layer_first")


@pytest.mark.parametrize("kind", ["mha", "mla", "mamba", "dense"])
def test_a_served_strided_pool_says_so_once_at_startup(host, caplog, kind):
    """One log line tells an operator that strided device views are served, and how far
    apart their rows lie; SGLang's own dense pools log nothing of the kind."""
    caplog.set_level("INFO")
    pool = {"mha": strided_mha, "mla": strided_mla, "mamba": lambda: mamba_pool("kvcached-contiguous", **MAMBA),
            "dense": dense_mha}[kind]()
    host("mha" if kind == "dense" else kind, pool, "layer_first" if kind == "mla" else "page_first")
    said = [r.getMessage() for r in caplog.records if "strided" in r.getMessage()]
    if kind == "dense":
        assert said == []
    else:
        assert len(said) == 1 and " B apart); host transfers step device " in said[0], said
