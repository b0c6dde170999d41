"""Mutants that cannot change behaviour, reviewed one by one; the run skips them.

An entry names the file, the line as it stands and the mutant's line (both stripped,
so that moving the line does not drop the entry), and why no test can tell the two
apart. Keep it short: every entry is a claim a reviewer must be able to check.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Equivalent:
    path: str
    original: str
    mutated: str
    reason: str

    @property
    def key(self):
        return (self.path, self.original, self.mutated)


_LRU_REASON = (
    "_unroll_for_batch is a pure function of its arguments; the cache's size (bounded, "
    "default 128, unbounded, or none at all) changes how often it is recomputed, never "
    "what it returns")

EQUIVALENT: list[Equivalent] = [
    Equivalent("sglang/kernels/ops/kvcache/hicache.py", "@functools.lru_cache(maxsize=4096)", mutated, _LRU_REASON)
    for mutated in ("@functools.lru_cache()", "@functools.lru_cache(maxsize=None)",
                    "@functools.lru_cache(maxsize=4097)", "@functools.lru_cache(maxsize=0)")
]
