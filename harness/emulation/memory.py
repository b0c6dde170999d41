"""Raw memory for the kernel emulation: argument checks, address bounds, byte copies.

The emulated kernels copy bytes with ctypes.memmove at the addresses the CUDA code
computes, so a wrong stride or table copies wrong bytes here exactly as on a GPU. Two
things keep such a bug from corrupting this process instead of failing a test:

* every copy whose base is a tensor argument is checked against that tensor's storage;
* every copy whose base comes from a pointer table (uint64 addresses) is checked
  against the storage of the tensor whose ``data_ptr()`` produced that address:
  ``AddressBook`` records them while the emulation is installed. An address no tensor
  handed out (a table built before installation, or a forged one) is copied unchecked,
  as the GPU would.

``Matcher`` is the CPU side of the JIT kernels' ``TensorMatcher`` (sgl_kernel/tensor.h):
shapes, strides and dtypes tied together through symbols, contiguity when no strides are
given. Devices are not checked: every tensor of the CPU tier is a CPU tensor, so the
device/host distinction the kernels enforce is left to the GPU tier.
"""
from __future__ import annotations

import ctypes

import torch

ANY = -1  # kAnySize


class KernelError(RuntimeError):
    """What the compiled kernel raises (TORCH_CHECK, RuntimeCheck, TensorMatcher, CUDA errors)."""


def check(condition: bool, message: str):
    if not condition:
        raise KernelError(message)


class Symbol:
    """A SymbolicSize / SymbolicDType: the first tensor verified binds it, later ones must agree."""

    def __init__(self, name: str, options: tuple = ()):
        self.name, self.options, self.value = name, options, None

    def bind(self, value, where: str):
        if self.options and value not in self.options:
            raise KernelError(f"{where}: {self.name} {value} is not one of {self.options}")
        if self.value is None:
            self.value = value
        elif self.value != value:
            raise KernelError(f"{where}: {self.name} mismatch, expected {self.value} but got {value}")
        return value

    def unwrap(self):
        assert self.value is not None, f"{self.name} was never bound"
        return self.value


def match(name: str, tensor, shape, *, strides=None, dtype=None):
    """TensorMatcher(shape).with_strides(strides).with_dtype(dtype).verify(tensor)."""
    where = f"Tensor match failed for {name}"
    check(isinstance(tensor, torch.Tensor), f"{where}: expected a tensor, got {type(tensor).__name__}")
    check(tensor.dim() == len(shape), f"{where}: dimension mismatch, expected {len(shape)} but got {tensor.dim()}")
    for i, want in enumerate(shape):
        if isinstance(want, Symbol):
            want.bind(tensor.size(i), f"{where} (shape {i})")
        elif want != ANY:
            check(tensor.size(i) == want, f"{where}: shape {i} is {tensor.size(i)}, expected {want}")
    if strides is None:
        check(tensor.is_contiguous(), f"{where}: Tensor is not contiguous as expected")
    else:
        for i, want in enumerate(strides):
            known = not isinstance(want, Symbol) or want.value is not None
            if tensor.size(i) == 1 and known:
                continue  # tensor.h skips the stride of a size-1 dimension it already knows
            if isinstance(want, Symbol):
                want.bind(tensor.stride(i), f"{where} (stride {i})")
            else:
                check(tensor.stride(i) == want, f"{where}: stride {i} is {tensor.stride(i)}, expected {want}")
    if dtype is not None:
        (dtype if isinstance(dtype, Symbol) else Symbol("dtype", tuple(dtype))).bind(tensor.dtype, where)
    return tensor


def as_int(name: str, value) -> int:
    """An int64_t parameter: tvm-ffi and torch.ops take Python ints (bools are ints to both)."""
    check(isinstance(value, int), f"{name}: expected an integer, got {type(value).__name__} ({value!r})")
    return int(value)


def ints(indices: torch.Tensor) -> list[int]:
    return indices.tolist()


class AddressBook:
    """Storage bounds of every address ``Tensor.data_ptr()`` handed out while installed."""

    def __init__(self):
        self.bounds: dict[int, tuple[int, int]] = {}
        self._original = None

    @property
    def installed(self) -> bool:
        return self._original is not None

    def install(self):
        original = self._original = torch.Tensor.data_ptr
        bounds = self.bounds

        def data_ptr(tensor):
            address = original(tensor)
            if tensor.device.type == "cpu" and address:
                storage = tensor.untyped_storage()
                base = storage.data_ptr()
                bounds[address] = (base, base + storage.nbytes())
            return address

        torch.Tensor.data_ptr = data_ptr

    def uninstall(self):
        if self._original is not None:
            torch.Tensor.data_ptr = self._original
            self._original = None
        self.bounds.clear()

    def raw(self, tensor: torch.Tensor) -> int:
        """The tensor's address, without recording it (the emulation's own look-ups)."""
        return (self._original or torch.Tensor.data_ptr)(tensor)


BOOK = AddressBook()


class Region:
    """Where a kernel may read or write from one base address: [low, high)."""

    __slots__ = ("base", "low", "high", "what")

    def __init__(self, base: int, low: int | None, high: int | None, what: str):
        self.base, self.low, self.high, self.what = base, low, high, what

    @classmethod
    def of_tensor(cls, tensor: torch.Tensor, what: str) -> "Region":
        storage = tensor.untyped_storage()
        low = storage.data_ptr()
        return cls(BOOK.raw(tensor), low, low + storage.nbytes(), what)

    @classmethod
    def of_address(cls, address: int, what: str) -> "Region":
        check(address != 0, f"{what}: null pointer in a kernel pointer table")
        low, high = BOOK.bounds.get(address, (None, None))
        return cls(address, low, high, what)

    def at(self, offset: int, nbytes: int) -> int:
        address = self.base + offset
        if self.low is not None and not (self.low <= address and address + nbytes <= self.high):
            raise KernelError(
                f"illegal memory access: {self.what} + {offset} ({nbytes} bytes) lies outside its "
                f"allocation [{self.low:#x}, {self.high:#x})")
        return address


def copy(dst: Region, dst_offset: int, src: Region, src_offset: int, nbytes: int):
    ctypes.memmove(dst.at(dst_offset, nbytes), src.at(src_offset, nbytes), nbytes)


def table(name: str, tensor: torch.Tensor, length) -> list[Region]:
    """A kernel pointer table: a contiguous 1-D uint64 tensor of `length` addresses."""
    match(name, tensor, (length,), dtype=(torch.uint64,))
    return [Region.of_address(a, f"{name}[{i}]") for i, a in enumerate(ints(tensor))]
