"""SGLang's entry points that build host pools, called as a server calls them.

publish() turns `sglang serve` flags into the published configuration; build() runs the
scenario's entry point over its device pools with the few objects those entry points
read from a radix cache and its init parameters (single rank, no tree, no eviction).
"""
from __future__ import annotations

import argparse
import threading
from types import SimpleNamespace

_FLAGS: dict[str, argparse.ArgumentParser] = {}


def _add_cli_args_once(real):
    """ServerArgs.add_cli_args as prepare_server_args calls it, its ~500 flags built from
    ServerArgs' fields once per process (40 ms a time, 422 cases): each later parser gets
    the same actions and defaults, as argparse's ``parents=`` gives them."""

    def add_cli_args(parser):
        if "flags" not in _FLAGS:
            _FLAGS["flags"] = argparse.ArgumentParser(add_help=False)
            real(_FLAGS["flags"])
        parser._add_container_actions(_FLAGS["flags"])
        parser._defaults.update(_FLAGS["flags"]._defaults)

    add_cli_args.once = True
    return staticmethod(add_cli_args)


def publish(flags):
    """Parse `sglang serve` flags and publish them as the scheduler does.

    The model path is SGLang's "dummy", for which the resolution pipeline stops before
    its HiCache step; that step's model-independent parts (the host-ratio default, the
    host-memory-mode check, the layout/io and storage/layout rewrites) are run here, in
    the pipeline's order, so each case gets the layout and io backend SGLang would use.
    Its DCP check needs the model's config and is not run."""
    from sglang.srt.arg_groups import hicache_hook as hook
    from sglang.srt.runtime_context import publish as publish_args, reset_context
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    if not getattr(ServerArgs.add_cli_args, "once", False):
        ServerArgs.add_cli_args = _add_cli_args_once(ServerArgs.add_cli_args)
    reset_context()
    server_args = prepare_server_args(["--model-path", "dummy", "--enable-hierarchical-cache", *flags])
    for step in (hook.handle_hicache_ratio_default, hook.validate_hicache_host_memory_mode,
                 hook.resolve_layout_io_compatibility, hook.resolve_storage_layout_compatibility):
        step(server_args)
    publish_args(server_args, role="scheduler")
    return server_args


class FakeUnifiedCache:
    """What attach_hybrid_pool_to_unified_cache and the draft sidecar builder read and
    write on a UnifiedRadixCache (no tree: nothing is ever evicted)."""

    def __init__(self, components, page_size, allocator, req_to_token_pool):
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        self.components = {ComponentType[name]: SimpleNamespace() for name in components}
        self.page_size = page_size
        self.token_to_kv_pool_allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self._enable_metrics_flag = False
        self.sidecars = {}

    def evict_host(self, num, component):
        return 0

    def register_sidecar_pool(self, spec, entry=None):
        self.sidecars[spec.pool_name] = spec.indices_from_pool
        if entry is not None:
            self.host_pool_group.add_entry(entry)


def params_for(pools):
    return SimpleNamespace(
        page_size=pools.page_size, token_to_kv_pool_allocator=pools.allocator,
        req_to_token_pool=pools.req_to_token_pool or SimpleNamespace(register_layer_transfer_counter=lambda c: None),
        tp_cache_group=None, attn_cp_cache_group=None, attn_tp_cache_group=None, pp_cache_group=None,
        mtp_draft_device_pools=pools.mtp_draft_device_pools, pp_size=1, pp_rank=0, enable_metrics=False)


def build(scenario, pools, server_args):
    """Run the scenario's SGLang entry point; returns (group, controller, sidecars)."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as asm

    params = params_for(pools)
    event = threading.Event()
    if scenario.entry in ("unified", "draft-sidecar"):
        cache = FakeUnifiedCache(pools.components, pools.page_size, pools.allocator, params.req_to_token_pool)
        asm.attach_hybrid_pool_to_unified_cache(cache, params, server_args, load_cache_event=event)
        if scenario.entry == "draft-sidecar":
            specs, entries = asm.build_hicache_draft_sidecars(draft_device_pools=pools.draft_device_pools,
                                                              tree_cache=cache)
            for spec, entry in zip(specs, entries, strict=True):
                cache.register_sidecar_pool(spec, entry)
        return cache.host_pool_group, cache.cache_controller, cache.sidecars
    radix = SimpleNamespace(kv_cache=pools.kvcache, page_size=pools.page_size)
    attach = {"hiradix-dsa": asm.attach_hybrid_dsa_pool_to_hiradix_cache,
              "hiradix-minimax": asm.attach_hybrid_minimax_sparse_pool_to_hiradix_cache}[scenario.entry]
    attach(radix, params, extra_config={}, prefetch_threshold=256, enable_storage_metrics=False,
           load_cache_event=event)
    return radix.token_to_kv_pool_host, radix.cache_controller, {}
