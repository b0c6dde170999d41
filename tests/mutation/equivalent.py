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

_POOL_HOST = "sglang/srt/mem_cache/pool_host/"

_DEVICE_TABLE_REASON = (
    "make_kernel_ptr_table reads host_memory_registered only for a table on a CUDA device, "
    "and None is as false as False: on CPU the flag is never read. With True on a GPU it "
    "would ask sglang-kernel's get_device_accessible_ptr for the address of device memory, "
    "which is the memory's own address (the JIT runtime's get_device_accessible_ptr, "
    "kernels/jit/include/sgl_kernel/runtime.cuh, returns data_ptr() for any tensor not in "
    "host memory); only the GPU tier could tell the two apart, and then only if that did "
    "not hold")

_STAGING_CAPACITY_REASON = (
    "staging_page_capacity and staging_token_capacity are read only inside "
    "_init_write_back_staging_buffers, to size the staging buffer, which has run by then "
    "and does not run again; no other code in SGLang 0.5.20 reads them")

_FLAG_ALREADY_OFF_REASON = (
    "when can_use_write_back_jit is already False, _init_write_back_staging_buffers has "
    "left exactly what the body sets (the flag False, the staging buffers None, the "
    "capacities 0), so running the body then changes nothing")

_PAGE_FIRST_ONLY_REASON = (
    "can_use_write_back_jit is True only for the page_first layout: "
    "_init_write_back_staging_buffers sets it False and returns for every other layout, "
    "and nothing else sets it True, so the layout test adds nothing to the flag")

EQUIVALENT: list[Equivalent] = [
    *(Equivalent("sglang/kernels/ops/kvcache/hicache.py", "@functools.lru_cache(maxsize=4096)", mutated,
                 _LRU_REASON)
      for mutated in ("@functools.lru_cache()", "@functools.lru_cache(maxsize=None)",
                      "@functools.lru_cache(maxsize=4097)", "@functools.lru_cache(maxsize=0)")),
    *(Equivalent(_POOL_HOST + path, original, original.replace("False", flag),
                 _DEVICE_TABLE_REASON)
      for path, original in (("common.py", "list(kind), device, host_memory_registered=False"),
                             ("mamba.py", "host_memory_registered=False,"),
                             ("mamba.py", "conv_layers, self.device_pool.device, host_memory_registered=False"))
      for flag in ("None", "True")),
    Equivalent(_POOL_HOST + "mha.py", "strided_device_layers: list[StridedDeviceLayers] | None = None", "pass",
               "the class-level default is never read: __init__ sets the attribute right after can_use_jit, "
               "and every reader (the packed pointer tables, _init_strided_device_backup, the backups) runs "
               "later; no subclass in SGLang 0.5.20 replaces that __init__ (AsymmetricMHATokenToKVPoolHost "
               "inherits it) and nothing builds the pool without it"),
    *(Equivalent(_POOL_HOST + path, "self.staging_page_capacity = self.staging_token_capacity = 0", mutated,
                 _STAGING_CAPACITY_REASON)
      for path in ("mha.py", "mla.py")
      for mutated in ("pass", "self.staging_page_capacity = self.staging_token_capacity = 1")),
    *(Equivalent(_POOL_HOST + path, "if len(self.strided_device_layers) > 1 and self.can_use_write_back_jit:",
                 "if len(self.strided_device_layers) > 1:", _FLAG_ALREADY_OFF_REASON)
      for path in ("mha.py", "mla.py")),
    *(Equivalent(_POOL_HOST + path, 'if self.layout == "page_first" and self.can_use_write_back_jit:',
                 "if self.can_use_write_back_jit:", _PAGE_FIRST_ONLY_REASON)
      for path in ("mha.py", "mla.py")),
    Equivalent("sglang/srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py", "if rows > served_rows:",
               "if rows >= served_rows:",
               "the two differ only at rows == served_rows, where the scaling computes "
               "total * served_rows // rows == total exactly (integers), the value left unscaled"),
]
