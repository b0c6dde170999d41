"""HiCache's third tier (L3) below SGLang's controller: a real Mooncake master, and trips
that go device -> host -> storage -> (host evicted) -> storage -> host -> device.

The storage side is SGLang's own: the HybridCacheController's storage threads (backup,
prefetch query, prefetch I/O, ack sync) and the backend SGLang builds for
`--hicache-storage-backend` (MooncakeStore over mooncake-transfer-engine, or HiCacheFile).
A trip drives the controller the way UnifiedRadixCache does:

  write(device rows) + start_writing            -> host rows         (L1 -> L2)
  write_storage(host rows, tokens, page hashes) -> backup thread      (L2 -> L3)
  evict_host(host rows); those rows overwritten                        (L2 gone)
  prefetch(tokens) -> hit query; host rows allocated; prefetch_buffer (L3 -> L2)
  load(host rows) + start_loading               -> new device rows   (L2 -> L1)

and checks content as ControllerRoundTrip does: the rows that come back equal the
originals byte for byte, and no other device or host byte changed.
"""
from __future__ import annotations

import os
import queue
from contextlib import contextmanager

import torch

from harness.mooncake_store import MooncakeMaster  # noqa: F401  (the harness's: one launcher)
from tests.support.controller import ControllerRoundTrip
from tests.support.roundtrip import as_bytes, poison

# Every wait on a storage thread is bounded; a hang fails the test.
THREAD_WAIT_S = 30
IBVERBS = "libibverbs.so.1"
REQUIRE_ENV = "SGLANG_TEST_REQUIRE_MOONCAKE"


def require_mooncake() -> None:
    """Mooncake's native libraries link libibverbs.so.1 (Debian's libibverbs1), even for TCP
    on loopback. Without it: skip (with the reason, shown by `make test`'s -rs), or fail
    where $SGLANG_TEST_REQUIRE_MOONCAKE=1 (.ci/run, which installs it)."""
    import ctypes

    import pytest

    try:
        ctypes.CDLL(IBVERBS)
    except OSError:
        reason = (f"{IBVERBS} missing: Mooncake's libraries link it (as root: apt-get install libibverbs1, "
                  "as .ci/run does)")
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason}; {REQUIRE_ENV}=1 requires the Mooncake tests to run")
        pytest.skip(reason)


@contextmanager
def single_rank():
    """Rank 0 of one (TP and PP), as a one-GPU scheduler sees it. The storage config reads
    these ranks from the process groups, which a test process does not build."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0, pp_rank=0):
        yield


def storage_options():
    """What UnifiedRadixCache.init_hicache hands the stack builders for the published
    --hicache-storage-backend flags (backend, parsed extra config, prefetch threshold)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.runtime_context import get_memory, get_serving

    extra, threshold, *_ = HybridCacheController.parse_storage_backend_extra_config(
        get_memory().hicache_storage_backend_extra_config)
    return dict(storage_backend=get_memory().hicache_storage_backend, storage_backend_extra_config=extra,
                prefetch_threshold=threshold, model_name=get_serving().served_model_name)


def sglang_mla_pool(pool):
    """The MLA stand-in as an MLATokenToKVPool, as kvcached's ElasticMLATokenToKVPool is
    (a subclass that skips the parent's buffer allocation). The controller tells MLA from
    MHA by that type (is_mla_model), and MooncakeStore keys and packs pages by it."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    class ElasticLikeMLAPool(MLATokenToKVPool):
        def __init__(self, attributes):
            self.__dict__.update(attributes)

    return ElasticLikeMLAPool(vars(pool))


def detach_storage(controller):
    """Stop the controller's storage threads (bounded: each polls its queue every second)
    and close the backend's client before its server goes away."""
    backend = controller.storage_backend
    controller.detach_storage_backend()
    client = getattr(backend, "store", None)
    if client is not None and hasattr(client, "close"):
        client.close()


def _get(q: queue.Queue, what: str):
    try:
        return q.get(timeout=THREAD_WAIT_S)
    except queue.Empty:
        raise AssertionError(f"no {what} from the storage threads within {THREAD_WAIT_S} s") from None


class StorageRoundTrip(ControllerRoundTrip):
    """Trips through the controller's L2 and L3 paths (KV pools; no extra pools)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trips_done = 0
        self.token_rng = torch.Generator().manual_seed(1234)

    def _evict_and_overwrite(self, host_rows):
        """Free the host rows and overwrite them through the host pool's own page writer,
        so that a prefetch that did not read storage leaves wrong bytes behind."""
        host_pool = self.controller.mem_pool_host.anchor_entry.host_pool
        self.controller.evict_host(host_rows)
        for start in host_rows[:: self.page_size].tolist():
            page = host_pool.get_dummy_flat_data_page()
            poison(page, self.token_rng)
            host_pool.set_from_flat_data_page(start, page)
        for family, host_model in zip(self.kv.families, self.kv.host):
            for layer in range(len(family.device)):
                host_model[layer][host_rows.cpu()] = as_bytes(family.host(layer)[host_rows.cpu()])

    def _backup_to_storage(self, host_rows, tokens, hashes):
        self.controller.write_storage(host_rows, tokens, hash_value=hashes)
        done = _get(self.controller.ack_backup_queue, "backup ack")
        assert done.completed_tokens == len(tokens), (
            f"storage backup wrote {done.completed_tokens} of {len(tokens)} tokens")

    def _prefetch_from_storage(self, tokens):
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        handle = CacheRequestHandle(rid=f"trip{self.trips_done}", attempt_id=0)
        operation = self.controller.prefetch(handle, tokens)
        hit = _get(self.controller.prefetch_hit_queue, "prefetch hit query")
        assert hit is operation
        assert hit.storage_hit_count == len(tokens), (
            f"storage reports {hit.storage_hit_count} of {len(tokens)} tokens stored")
        # What the radix cache requires before it fetches (smaller hits are revoked).
        assert hit.storage_hit_count >= self.controller.prefetch_threshold
        host_rows = self.controller.mem_pool_host.alloc(len(tokens))
        assert host_rows is not None, "host pool full"
        operation.host_indices = host_rows
        self.controller.prefetch_buffer.put(operation)
        completed = 0
        while True:
            ack = _get(self.controller.ack_prefetch_queue, "prefetch ack")
            if ack.completed_tokens is not None:
                completed = ack.completed_tokens
            if ack.completed_req:
                break
        assert completed == len(tokens), f"prefetch read {completed} of {len(tokens)} tokens from storage"
        return host_rows

    def trip(self):
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        src = self._pick_data_rows()
        # Distinct token ids per trip, so every trip's page hashes (storage keys) are new.
        tokens = torch.randint(0, 1 << 30, (len(src),), generator=self.token_rng).tolist()
        hashes = get_storage_hash_str(tokens, None, page_size=self.page_size)
        self.trips_done += 1
        host = self._write(src)
        self._backup_to_storage(host, tokens, hashes)
        self._evict_and_overwrite(host)
        fetched = self._prefetch_from_storage(tokens)
        self.kv.check_backup(fetched, src)
        dst = self._load(fetched, src)
        self.controller.evict_host(fetched)
        self.controller.mem_pool_device_allocator.free(dst)
