"""kvcached 0.1.6's paged allocator with fewer GPU waits, for one benchmark variant.

The capped-pool profile (../2026-12-05-h100-bench-server-capped-profile) found kvcached's extra
scheduler time in two places where SGLang 0.5.20's own paged allocator does not wait for the GPU:

1. Eviction. The radix cache frees evicted leaves through ``free_segment``. kvcached's
   allocator inherits the base class's, which calls ``free``: ``torch.unique`` on the GPU, then
   ``.cpu()``. Here, as SGLang's paged allocator does, one index per page
   (``free_index[::page_size]``); the page ids go to pinned memory without waiting and are
   handed to kvcached once the copy has landed (an event, polled at the next ``available_size``
   or allocation, waited for only when an allocation cannot be served without them).
   ``available_size`` counts them meanwhile, so the scheduler evicts exactly as before.
2. Allocation. ``alloc_extend`` and ``alloc_decode`` upload the page ids kvcached returns with
   ``torch.tensor(list, device="cuda")``: a pageable copy, after which torch waits for the
   stream. Here the same ids go through pinned memory with ``non_blocking=True``.

This is a measurement, not a fix we ship: it shows what kvcached gains by changing both. It
is loaded in every process by a .pth file beside kvcached's own (``import kvcached_sync_free``),
after kvcached's autopatch, and does nothing unless ELASTIC_BENCH_SYNC_FREE=1. SGLang 0.5.20's
free-group protocol (``free_group is None`` outside a group) is assumed.
"""
import collections
import os

if os.environ.get("ELASTIC_BENCH_SYNC_FREE") == "1":
    import importlib

    from wrapt.importer import when_imported

    @when_imported("sglang")
    def _install(_sglang):
        # runs after kvcached's own hook on "sglang" (its .pth sorts first), which defined the class
        cls = getattr(importlib.import_module("sglang.srt.mem_cache.allocator"),
                      "ElasticPagedTokenToKVPoolAllocator", None)
        if cls is None:
            raise RuntimeError("kvcached_sync_free: kvcached's ElasticPagedTokenToKVPoolAllocator is missing "
                               "(is kvcached's autopatch on and loaded first?)")
        _without_waits(cls)


def _pending(allocator) -> collections.deque:
    """(event, pinned page ids) freed but not yet handed to kvcached, oldest first."""
    return allocator.__dict__.setdefault("_sync_free_pending", collections.deque())


def _hand_over(allocator, wait: bool = False) -> None:
    pending = _pending(allocator)
    while pending and (wait or pending[0][0].query()):
        landed, ids = pending.popleft()
        landed.synchronize()
        allocator.kvcached_allocator.free(ids.tolist())


def _without_waits(cls) -> None:
    import torch

    class _UploadWithoutWait:
        """torch, except that tensor(list, device=cuda) copies through pinned memory, non_blocking."""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def tensor(data, *args, dtype=None, device=None, **kwargs):
            if isinstance(data, list) and not args and not kwargs and device is not None \
                    and torch.device(device).type == "cuda":
                return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
            return torch.tensor(data, *args, dtype=dtype, device=device, **kwargs)

    # kvcached's methods find torch in the closure of the function that defined the class
    # (a local `import torch`): point that one cell at the wrapper
    cells = dict(zip(cls.alloc_extend.__code__.co_freevars, cls.alloc_extend.__closure__ or ()))
    if "torch" not in cells:
        raise RuntimeError("kvcached_sync_free: alloc_extend does not take torch from a closure")
    cells["torch"].cell_contents = _UploadWithoutWait()

    queued_free_page_ids = cls.free_page_ids      # kvcached's: inside a free group it queues
    available_size = cls.available_size

    def free_segment(self, free_index, *, start_pos):
        assert start_pos % self.page_size == 0, f"segment start {start_pos} is not page-aligned"
        if free_index.numel():
            self.free_page_ids(free_index[:: self.page_size] // self.page_size)

    def free_page_ids(self, page_ids):
        if page_ids.numel() == 0:
            return
        if self.free_group is not None:
            return queued_free_page_ids(self, page_ids)
        ids = torch.empty(page_ids.shape, dtype=torch.int64, pin_memory=True)
        ids.copy_(page_ids, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        _pending(self).append((landed, ids))

    def counting_pending(self):
        _hand_over(self)
        return available_size(self) + self.page_size * sum(ids.numel() for _, ids in _pending(self))

    def retried_after_hand_over(alloc):
        def wrapper(self, *args, **kwargs):
            _hand_over(self)
            out = alloc(self, *args, **kwargs)
            if out is None and _pending(self):
                _hand_over(self, wait=True)
                out = alloc(self, *args, **kwargs)
            return out
        return wrapper

    clear = cls.clear

    def clear_after_hand_over(self):
        _hand_over(self, wait=True)
        clear(self)

    cls.free_segment, cls.free_page_ids, cls.available_size = free_segment, free_page_ids, counting_pending
    for name in ("alloc", "alloc_extend", "alloc_decode"):
        setattr(cls, name, retried_after_hand_over(getattr(cls, name)))
    cls.clear = clear_after_hand_over
