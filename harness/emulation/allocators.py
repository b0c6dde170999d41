"""The allocators a radix cache hands SGLang's cache controller, as small stand-ins: the
token allocator loads go into (whole pages from a free list) and the Mamba slot allocator.
Used by the differential gate's scenarios and by the tests' controller trips."""
from __future__ import annotations

import torch


def pages_to_rows(pages, page_size: int) -> torch.Tensor:
    """The token rows of whole pages, in page order."""
    base = torch.as_tensor(list(pages), dtype=torch.int64)[:, None] * page_size
    return (base + torch.arange(page_size, dtype=torch.int64)[None, :]).reshape(-1)


class PageAllocator:
    """The token allocator the controller loads into: whole pages from a free list."""

    def __init__(self, kv_pool, pages, page_size, device, rng):
        self.kv_pool, self.page_size, self.device, self.rng = kv_pool, page_size, device, rng
        self.free_pages = list(pages)

    def get_kvcache(self):
        return self.kv_pool

    def alloc(self, num_tokens):
        assert num_tokens % self.page_size == 0
        pages = self.rng.sample(self.free_pages, num_tokens // self.page_size)
        for page in pages:
            self.free_pages.remove(page)
        return pages_to_rows(pages, self.page_size).to(self.device)

    def free(self, tokens):
        self.free_pages += sorted({t // self.page_size for t in tokens.tolist()})


class SlotAllocator:
    """The Mamba slot allocator (HybridReqToTokenPool.mamba_allocator)."""

    def __init__(self, slots, device, rng):
        self.free_slots, self.device, self.rng = list(slots), device, rng

    def alloc(self, n):
        slots = self.rng.sample(self.free_slots, n)
        for slot in slots:
            self.free_slots.remove(slot)
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def free(self, slots):
        self.free_slots += slots.tolist()
