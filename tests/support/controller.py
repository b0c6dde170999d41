"""Backup and load through SGLang's HybridCacheController, as the radix cache drives it.

The host pools and the controller are built by SGLang's own assembler functions
(build_kv_only_stack, build_hybrid_mamba_stack) from a ServerArgs parsed from flags and
published as the scheduler publishes it, so host layout, io backend and --hicache-size
split are SGLang's defaults unless a test passes flags. A trip is a backup (write, with
the Mamba slot as an extra pool) and a later prefix hit (load + start_loading), checked
on content as in roundtrip.py. Used by the CPU tier (kernels emulated, torch.cpu's
streams and events) and the GPU tier (real kvcached pools, JIT kernels and streams).
"""
from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import torch

from tests.support.roundtrip import Expected, pages_to_rows


def publish_server_args(*flags: str):
    """Parse `sglang serve` flags into a ServerArgs and publish it like the scheduler."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(["--model-path", "dummy", "--enable-hierarchical-cache", *flags])
    publish(server_args, role="scheduler")
    return server_args


def cache_init_params(kv_pool, page_allocator, slot_allocator=None):
    """The fields of CacheInitParams that the stack builders read (single rank, no MTP)."""
    return SimpleNamespace(
        page_size=page_allocator.page_size,
        token_to_kv_pool_allocator=page_allocator,
        req_to_token_pool=SimpleNamespace(mamba_allocator=slot_allocator),
        tp_cache_group=None, attn_cp_cache_group=None, attn_tp_cache_group=None, pp_cache_group=None,
        mtp_draft_device_pools=(),
    )


def build_stack(params, kv_pool, *, use_mla, full_layers, mamba_pool=None, linear_layers=(), **storage):
    """SGLang's own builders, as _PlainKvStrategy / _MambaStrategy call them; `storage`: the
    storage options UnifiedRadixCache.init_hicache adds (none: no storage backend)."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as asm

    storage.setdefault("storage_backend", None)
    full_mapping = {layer: i for i, layer in enumerate(full_layers)}
    common = dict(params=params, kv_pool=kv_pool, full_layer_mapping=full_mapping,
                  load_cache_event=threading.Event(), use_mla=use_mla, **storage)
    if mamba_pool is None:
        return asm.build_kv_only_stack(**common)
    return asm.build_hybrid_mamba_stack(
        **common, mamba_pool=mamba_pool, mamba_layer_mapping={layer: i for i, layer in enumerate(linear_layers)})


def release_host_pools(group):
    """Unregister the host pools' pinned buffers (cudaHostRegister): a later pool may
    be given the same addresses, and registering them twice fails."""
    for entry in group.entries:
        destroy = getattr(entry.host_pool, "destroy", None)
        if destroy is not None:
            destroy()


class ControllerRoundTrip:
    """Trips through a controller; expected device and host bytes are modelled per row.

    kv_families / mamba_families: Rows per K, V (or KV) and per Mamba state, whose host
    images index host rows. data_pages / data_slots hold the originals (never written);
    the allocators hand out the other used pages and slots as load targets.
    """

    def __init__(self, controller, group, kv_families, mamba_families, *, page_size,
                 data_pages, scratch_pages, data_slots=(), scratch_slots=(), device, seed=0,
                 max_pages=3):
        from sglang.srt.mem_cache.hicache_storage import PoolName

        self.controller, self.group, self.device = controller, group, device
        self.page_size, self.max_pages = page_size, max_pages
        self.rng = random.Random(seed)
        self.data_pages, self.data_slots = list(data_pages), list(data_slots)
        self.mamba = PoolName.MAMBA
        self.kv = Expected(kv_families, pages_to_rows([*data_pages, *scratch_pages], page_size))
        self.states = Expected(mamba_families, torch.tensor([*data_slots, *scratch_slots], dtype=torch.int64))

    def _wait(self, acks):
        acks[-1].finish_event.synchronize()
        acks.clear()

    def _pick_data_rows(self):
        n = self.rng.randint(1, self.max_pages)
        return pages_to_rows(self.rng.sample(self.data_pages, n), self.page_size).to(self.device)

    def _write(self, src, extra=None):
        """write + start_writing, as a backup does; checks the host rows written."""
        host = self.controller.write(src, extra_pools=extra)
        assert host is not None, "host pool full"
        self.controller.start_writing()
        self._wait(self.controller.ack_write_queue)
        self.kv.check_backup(host, src)
        return host

    def _load(self, host, src, extra=None):
        """load + start_loading, as a prefix hit does; checks the device rows loaded."""
        dst = self.controller.load(host, extra_pools=extra)
        assert dst is not None, "device pool full"
        self.controller.start_loading()
        self._wait(self.controller.ack_load_queue)
        self.kv.check_load(src, dst)
        return dst

    def trip(self):
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        src = self._pick_data_rows()
        extra = load_extra = None
        if self.states.families:
            slot = torch.tensor([self.rng.choice(self.data_slots)], dtype=torch.int64, device=self.device)
            extra = [PoolTransfer(name=self.mamba, device_indices=slot)]
        host = self._write(src, extra)
        if extra:
            host_slot = extra[0].host_indices
            self.states.check_backup(host_slot, slot)
            load_extra = [PoolTransfer(name=self.mamba, host_indices=host_slot)]
        dst = self._load(host, src, load_extra)
        self.group.free(host)
        self.controller.mem_pool_device_allocator.free(dst)
        if load_extra:
            self.states.check_load(slot, load_extra[0].device_indices)
            self.group.free(host_slot, pool=self.mamba)
            self.group.get_entry(self.mamba).device_free_fn(load_extra[0].device_indices)

    def run(self, trips):
        for _ in range(trips):
            self.trip()
        self.kv.check_untouched()
        self.states.check_untouched()


def run_on_cpu(monkeypatch):
    """The controller on a machine without CUDA: torch.cpu's streams and events (copies
    run eagerly), and no cudaHostRegister of host pools."""
    from sglang.srt.managers import cache_controller
    from sglang.srt.mem_cache import l2_transfer
    from sglang.srt.mem_cache.pool_host import common

    for module in (cache_controller, l2_transfer):
        monkeypatch.setattr(module, "device_module", torch.cpu)
    monkeypatch.setattr(common, "_cuda_host_register", lambda *args, **kwargs: None)
