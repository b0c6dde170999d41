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


_POOL_HOST = "sglang/srt/mem_cache/pool_host/"

_DEVICE_TABLE_REASON = (
    "make_kernel_ptr_table reads host_memory_registered only for a table on a CUDA device, "
    "and None is as false as False: on CPU the flag is never read. With True on a GPU it "
    "would ask sglang-kernel's get_device_accessible_ptr for the address of device memory, "
    "which is the memory's own address (the JIT runtime's get_device_accessible_ptr, "
    "kernels/jit/include/sgl_kernel/runtime.cuh, returns data_ptr() for any tensor not in "
    "host memory); only the GPU tier could tell the two apart, and then only if that did "
    "not hold")

EQUIVALENT: list[Equivalent] = [
    *(Equivalent(_POOL_HOST + "base.py", "host_memory_registered=False,", "host_memory_registered=" + flag + ",",
                 _DEVICE_TABLE_REASON)
      for flag in ("None", "True")),
    Equivalent("sglang/srt/mem_cache/memory_pool.py",
               "return total * served_rows // rows if rows > served_rows else total",
               "return total * served_rows // rows if rows >= served_rows else total",
               "the two differ only at rows == served_rows, where the scaling computes "
               "total * served_rows // rows == total exactly (integers), the value left unscaled"),
]
