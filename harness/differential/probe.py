"""What a case's outcome records of its objects, in a form two processes can compare.

The objects are the host pools and device pools of a built stack. Their tensors are
found by walking the objects' own attributes (into lists, tuples, dicts, dataclasses and
namespaces, not into other objects), so that a buffer cannot be left out by a list
written here. Each distinct storage is then

* hashed whole (sha256 of its bytes: every byte, also those no view reaches), under the
  shortest attribute path that reaches it, e.g. ``kv.host.kv_buffer``;
* or, for uint64 tensors (SGLang's kernel pointer tables), read as addresses and written
  as ``storage-name+offset``, so that a table pointing at the wrong layer shows, while
  the process's own addresses do not.

Scalar attributes (sizes, page counts, layouts, dtypes) are recorded by name. Nothing
here knows a pool class.
"""
from __future__ import annotations

import dataclasses
import enum
import hashlib
import re
from types import SimpleNamespace

import torch

POINTER_DTYPE = torch.uint64
# Integer and boolean tensors are indices and allocator state: hashed, never filled.
NOT_DATA = (torch.int32, torch.int64, torch.uint64, torch.bool)
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


MAX_DEPTH = 4


def _is_sglang_object(value) -> bool:
    return type(value).__module__.startswith("sglang.") and not isinstance(value, type)


def _children(value, path, depth, seen, roots):
    if isinstance(value, torch.Tensor):
        yield path, value
        return
    if depth >= MAX_DEPTH or id(value) in seen or (depth > 0 and id(value) in roots):
        return
    seen = seen | {id(value)}
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _children(item, f"{path}[{i}]", depth + 1, seen, roots)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _children(value[key], f"{path}[{key}]", depth + 1, seen, roots)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _children(getattr(value, field.name), f"{path}.{field.name}", depth + 1, seen, roots)
    elif isinstance(value, SimpleNamespace) or _is_sglang_object(value):
        for key, item in sorted(getattr(value, "__dict__", {}).items()):
            yield from _children(item, f"{path}.{key}", depth + 1, seen, roots)


def tensors(roots: dict[str, object]) -> dict[str, torch.Tensor]:
    """Every tensor reachable from the roots' attributes, by attribute path.

    The walk enters lists, tuples, dicts, dataclasses, namespaces and SGLang's own
    objects (a pool's index cache, say), never another root (it is walked as itself)."""
    found = {}
    root_ids = {id(root) for root in roots.values()}
    for name, root in roots.items():
        for path, tensor in _children(root, name, 0, frozenset(), root_ids):
            found[path] = tensor
    return found


def _storage_key(tensor):
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes(), tensor.device.type


def storages(found: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One tensor per distinct storage, named by the shortest path that reaches it."""
    by_key: dict[tuple, tuple[str, torch.Tensor]] = {}
    for path, tensor in found.items():
        key = _storage_key(tensor)
        if key[1] == 0:
            continue
        if key not in by_key or (len(path), path) < (len(by_key[key][0]), by_key[key][0]):
            by_key[key] = (path, tensor)
    return dict(sorted(by_key.values(), key=lambda item: item[0]))


def storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under a tensor, as a flat uint8 tensor on the CPU."""
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    flat.set_(tensor.untyped_storage())
    return flat.cpu()


def sha256(tensor: torch.Tensor) -> str:
    """sha256 of the whole storage under a tensor."""
    return hashlib.sha256(storage_bytes(tensor).numpy().tobytes()).hexdigest()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's own elements, in order (not of its storage)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


class AddressBook:
    """Turns raw addresses into `storage+offset` against the storages of a snapshot."""

    def __init__(self, named: dict[str, torch.Tensor]):
        self.ranges = sorted((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), name)
                             for name, t in named.items())

    def name(self, address: int) -> str:
        for start, size, name in self.ranges:
            if start <= address < start + size:
                return f"{name}+{address - start}"
        return "unknown-address"

    def names(self, addresses) -> list[str]:
        return [self.name(int(a)) for a in addresses]


def _scalar(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (list, tuple)) and len(value) <= 64:
        items = [_scalar(v) for v in value]
        return _NOT_SCALAR if any(i is _NOT_SCALAR for i in items) else items
    return _NOT_SCALAR


_NOT_SCALAR = object()


def scalars(roots: dict[str, object]) -> dict[str, object]:
    """Public scalar attributes (sizes, counts, layouts, flags, dtypes) of each root."""
    out = {}
    for name, root in roots.items():
        for attr, value in sorted(getattr(root, "__dict__", {}).items()):
            if attr.startswith("_"):
                continue
            value = _scalar(value)
            if value is not _NOT_SCALAR:
                out[f"{name}.{attr}"] = value
    return out


def snapshot(roots: dict[str, object], *, layout: bool, hashes: bool = True) -> dict:
    """Hashes (unless hashes=False) and pointer tables of every storage; with layout,
    also every tensor's shape, strides and place, and the roots' scalar attributes."""
    found = tensors(roots)
    named = storages(found)
    book = AddressBook(named)
    state = {
        "pointers": {path: book.names(t.reshape(-1).tolist()) for path, t in found.items()
                     if t.dtype == POINTER_DTYPE},
    }
    if hashes:
        state["hashes"] = {name: sha256(t) for name, t in named.items() if t.dtype != POINTER_DTYPE}
    if layout:
        where = {_storage_key(t): name for name, t in named.items()}
        state["tensors"] = {
            path: {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype),
                   "storage": where.get(_storage_key(t), "empty"),
                   "offset": t.storage_offset() * t.element_size()}
            for path, t in found.items()
        }
        state["scalars"] = scalars(roots)
    return state


def fill(roots: dict[str, object], generator: torch.Generator) -> None:
    """Random bytes in every data storage of the roots (indices and tables excepted)."""
    for tensor in storages(tensors(roots)).values():
        if tensor.dtype in NOT_DATA:
            continue
        flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        flat.set_(tensor.untyped_storage())
        # Eight random bytes per draw: a quarter of the time of one per byte.
        words = torch.randint(-2**63, 2**63 - 1, ((flat.numel() + 7) // 8,), generator=generator, dtype=torch.int64)
        flat.copy_(words.view(torch.uint8)[:flat.numel()])


def clean_message(text: str, trees: tuple[str, ...] = ()) -> str:
    """An exception message without what differs between two processes or trees."""
    for tree in trees:
        text = text.replace(tree, "<tree>")
    return _ADDRESS.sub("0x?", text)
