"""Device pools with kvcached 0.1.6's view geometry, on CPU tensors.

kvcached cannot run without CUDA, so the CPU tier rebuilds its views here, line for
line from kvcached 0.1.6 (kvcached/integration/sglang/interfaces.py: alloc_kv_cache and
alloc_mamba_states), over a small stand-in for the GPU's memory. What the patches
depend on is reproduced exactly: which bytes each per-layer view addresses (shape,
strides, offsets), VA-sized buffers (far more rows than the pool's tokens), the padded
Mamba cell, and kvcached's per-layer Mamba holder whose .conv/.temporal are layer 0's.

The pools are SimpleNamespace fakes carrying the attributes SGLang's host pools read,
as in SGLang's own CPU unit tests for host pools.
"""
from __future__ import annotations

import math
from types import MethodType, SimpleNamespace

import torch

# Stand-ins for the GPU's total memory and kvcached's physical page (KVCACHED_PAGE_SIZE).
FAKE_GPU_BYTES = 96 << 20
FAKE_PAGE = 64 << 10
LAYOUTS = ("native", "kvcached-contiguous", "kvcached-per-layer")


def _dense_strides(shape):
    """Element strides of a contiguous tensor of this shape."""
    return [math.prod(shape[i + 1:]) for i in range(len(shape))]


def _kv_views(layout, rows_wanted, page_size, row_shape, layers, dtype, num_k_or_v):
    """(list of per-layer view lists), following alloc_kv_cache."""
    if layout == "native":
        shape = (rows_wanted, *row_shape)
        return [[torch.zeros(shape, dtype=dtype) for _ in range(layers)] for _ in range(num_k_or_v)]
    is_mla = num_k_or_v == 1
    block_mem = page_size * math.prod(row_shape) * dtype.itemsize
    per_layer = FAKE_GPU_BYTES // layers // num_k_or_v
    align = 2 * FAKE_PAGE if is_mla else FAKE_PAGE
    per_layer = per_layer // align * align
    blocks = per_layer // block_mem
    tokens = blocks * page_size
    assert tokens >= rows_wanted, "fake GPU too small for the requested pool"
    if layout == "kvcached-contiguous":
        buffer = torch.zeros(per_layer * num_k_or_v * layers // dtype.itemsize, dtype=dtype)
        shape = (tokens, layers, num_k_or_v, *row_shape)
        whole = buffer[: math.prod(shape)].view(shape)
        return [[whole[:, l, kv] for l in range(layers)] for kv in range(num_k_or_v)]
    # per-layer: one buffer per layer, K in [0, per_layer), V in [per_layer, 2 * per_layer)
    views = [[] for _ in range(num_k_or_v)]
    for _ in range(layers):
        raw = torch.zeros(per_layer * num_k_or_v // dtype.itemsize, dtype=dtype)
        kv = torch.as_strided(raw, (num_k_or_v, tokens, *row_shape),
                              (per_layer // dtype.itemsize, *_dense_strides((tokens, *row_shape))))
        for i in range(num_k_or_v):
            views[i].append(kv[i])
    return views


def _kv_sizes(views, dtype):
    return tuple(sum(v.numel() for v in group) * dtype.itemsize for group in views)


def _with_sglang_methods(pool, class_name, *names):
    """Bind the SGLang pool class's own methods of these names to a fake, where the tree
    on the path has them (the patched tree's host-budget split reads them)."""
    from sglang.srt.mem_cache import memory_pool

    cls = getattr(memory_pool, class_name)
    for name in names:
        if hasattr(cls, name):
            setattr(pool, name, MethodType(getattr(cls, name), pool))
    return pool


def mha_pool(layout, *, size, page_size, layers, heads, head_dim, dtype=torch.bfloat16):
    k, v = _kv_views(layout, size + page_size, page_size, (heads, head_dim), layers, dtype, 2)
    pool = SimpleNamespace(
        k_buffer=k, v_buffer=v, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, layer_num=layers,
        size=size, page_size=page_size, dtype=dtype, store_dtype=dtype, device="cpu", start_layer=0,
        end_layer=layers - 1, layer_shard_enabled=False,
    )
    pool.get_kv_size_bytes = lambda: _kv_sizes((pool.k_buffer, pool.v_buffer), dtype)
    if all(view.is_contiguous() for view in (*k, *v)):
        # SGLang's pools publish these; kvcached's elastic pool too, unless its
        # views are interleaved (patches.py: _init_data_ptrs_and_strides skipped).
        pool.k_data_ptrs = torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64)
        pool.v_data_ptrs = torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64)
    return _with_sglang_methods(pool, "MHATokenToKVPool", "get_logical_kv_size_bytes", "_kv_buffer_rows")


def mla_pool(layout, *, size, page_size, layers, kv_lora_rank, qk_rope_head_dim, dtype=torch.bfloat16):
    kv_dim = kv_lora_rank + qk_rope_head_dim
    (kv,) = _kv_views(layout, size + page_size, page_size, (1, kv_dim), layers, dtype, 1)
    pool = SimpleNamespace(
        kv_buffer=kv, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, kv_cache_dim=kv_dim,
        layer_num=layers, size=size, page_size=page_size, dtype=dtype, store_dtype=dtype, device="cpu",
        start_layer=0, end_layer=layers - 1, layer_shard_enabled=False, use_dsa=False, use_nsa=False,
        dsa_kv_cache_store_fp8=False,
    )
    pool.get_kv_size_bytes = lambda: _kv_sizes((pool.kv_buffer,), dtype)
    # Native pools, and kvcached's elastic MLA pool too, publish data_ptrs.
    pool.data_ptrs = torch.tensor([t.data_ptr() for t in kv], dtype=torch.uint64)
    return _with_sglang_methods(pool, "MLATokenToKVPool", "get_logical_kv_size_bytes", "_kv_buffer_rows")


class PerLayerMambaState:
    """kvcached 0.1.6's _PerLayerMambaState: .conv/.temporal are layer 0's tensors."""

    def __init__(self, state_cls, conv_per_layer, temporal_per_layer):
        self._state_cls = state_cls
        self.conv_per_layer, self.temporal_per_layer = conv_per_layer, temporal_per_layer

    @property
    def conv(self):
        return [c[0] for c in self.conv_per_layer]

    @property
    def temporal(self):
        return self.temporal_per_layer[0]

    def at_layer_idx(self, layer):
        return self._state_cls(conv=[c[layer] for c in self.conv_per_layer],
                               temporal=self.temporal_per_layer[layer])


def mamba_pool(layout, *, slots, layers, conv_shapes, temporal_shape, conv_dtype=torch.bfloat16,
               temporal_dtype=torch.float32, page_bytes=4 << 20):
    """A Mamba pool with `slots` usable slots (plus kvcached's null slot 0)."""
    from sglang.srt.mem_cache.memory_pool import MambaPool

    num_slots = slots + 1
    if layout == "native":
        conv = [torch.zeros((layers, num_slots, *s), dtype=conv_dtype) for s in conv_shapes]
        temporal = torch.zeros((layers, num_slots, *temporal_shape), dtype=temporal_dtype)
        cache = MambaPool.State(conv=conv, temporal=temporal)
    else:
        align = lambda x, a: (x + a - 1) // a * a
        offsets, offset = [], 0
        for s in conv_shapes:
            offset = align(offset, conv_dtype.itemsize)
            offsets.append(offset)
            offset += math.prod(s) * conv_dtype.itemsize
        offset = align(offset, temporal_dtype.itemsize)
        temporal_offset = offset
        offset += math.prod(temporal_shape) * temporal_dtype.itemsize
        raw_cell = align(offset, max(conv_dtype.itemsize, temporal_dtype.itemsize))
        assert raw_cell <= page_bytes, "state cell exceeds the page: raise KVCACHED_PAGE_SIZE_MB"
        cell = min(d for d in range(raw_cell, page_bytes + 1) if page_bytes % d == 0)
        per_layer = align(num_slots * cell, page_bytes)

        if layout == "kvcached-contiguous":
            flat = torch.zeros(per_layer * layers, dtype=torch.int8)

            def view(shape, dtype, off):
                isz = dtype.itemsize
                return torch.as_strided(flat.view(dtype), (layers, num_slots, *shape),
                                        [cell // isz, layers * cell // isz, *_dense_strides(shape)], off // isz)
            cache = MambaPool.State(conv=[view(s, conv_dtype, o) for s, o in zip(conv_shapes, offsets)],
                                    temporal=view(temporal_shape, temporal_dtype, temporal_offset))
        else:
            raws = [torch.zeros(per_layer, dtype=torch.int8) for _ in range(layers)]

            def view(raw, shape, dtype, off):
                isz = dtype.itemsize
                return torch.as_strided(raw.view(dtype), (num_slots, *shape), [cell // isz, *_dense_strides(shape)],
                                        off // isz)
            cache = PerLayerMambaState(
                MambaPool.State,
                [[view(r, s, conv_dtype, o) for r in raws] for s, o in zip(conv_shapes, offsets)],
                [view(r, temporal_shape, temporal_dtype, temporal_offset) for r in raws],
            )
    state_bytes = (sum(math.prod(s) for s in conv_shapes) * conv_dtype.itemsize
                   + math.prod(temporal_shape) * temporal_dtype.itemsize)
    pool = SimpleNamespace(mamba_cache=cache, num_mamba_layers=layers, size=slots, device="cpu")
    # MambaPool.get_kv_size_bytes counts its state tensors (logical slots), as kvcached's does.
    pool.get_kv_size_bytes = lambda: layers * num_slots * state_bytes
    return _with_sglang_methods(pool, "MambaPool", "get_logical_kv_size_bytes", "mamba2_layer_cache")
