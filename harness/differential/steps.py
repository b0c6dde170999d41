"""The steps of a case after construction: trips through the controller, the storage path.

A trip is what the radix cache does on a backup and on a later prefix hit: write()
device pages (with a Mamba slot, SWA rows and the sidecars the group has), then load()
the host pages back into pages the controller allocates. The storage steps call each
host pool's L3 storage interface once per scenario and host layout.
"""
from __future__ import annotations

import torch

from harness.differential import probe

TRIPS = 2
TRIP_PAGES = 2


def describe(group, controller):
    entries = []
    for entry in group.entries:
        mapped = {layer: entry.layer_mapper(layer) for layer in range(controller.layer_num + 3)}
        entries.append({"name": str(entry.name), "host_pool": type(entry.host_pool).__name__,
                        "device_pool": type(entry.device_pool).__name__, "anchor": entry.is_primary_index_anchor,
                        "layers": {str(k): v for k, v in mapped.items()},
                        "packed_drafts": len(entry.packed_draft_device_pools)})
    return {"entries": entries, "controller": type(controller).__name__}


def pool_roots(group):
    roots = {}
    for entry in group.entries:
        roots[f"{entry.name}.host"] = entry.host_pool
        if entry.device_pool is not None:
            roots[f"{entry.name}.device_pool"] = entry.device_pool
    return roots


class Trip:
    """A backup of random data pages through the controller, then a load of them."""

    def __init__(self, case, group, controller, sidecars, pools):
        self.case, self.group, self.controller = case, group, controller
        self.sidecars, self.pools = sidecars, pools
        self.host = None
        self.extra = []

    def _pick(self, rows, count, unit):
        units = sorted({int(r) // unit for r in rows.tolist()})
        chosen = self.case.rng.sample(units, count)
        return torch.cat([torch.arange(u * unit, (u + 1) * unit) for u in chosen]).to(rows.device)

    def write(self):
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        page = self.pools.page_size
        device = self._pick(self.pools.data["kv"], self.pools.trip_pages, page)
        extra = []
        for entry in self.group.entries:
            if entry is self.group.anchor_entry:
                continue
            name = entry.name
            if name in self.sidecars:
                extra.append(PoolTransfer(name=name, indices_from_pool=self.sidecars[name]))
            elif str(name) in self.pools.data:  # a pool with indices of its own (SWA rows, Mamba slots)
                unit = self.pools.units[str(name)]
                count = 1 if unit == 1 else TRIP_PAGES  # a request has one Mamba slot
                extra.append(PoolTransfer(name=name, device_indices=self._pick(self.pools.data[str(name)], count,
                                                                                unit)))
            else:
                extra.append(PoolTransfer(name=name, indices_from_pool=self.group.anchor_entry.name))
        self.extra = extra
        self.host = self.controller.write(device, extra_pools=extra or None)
        if self.host is None:
            raise RuntimeError("host pool full")
        self.controller.start_writing()
        wait(self.controller.ack_write_queue)
        self.host_page = int(self.host[0])
        return {"host": self.host.tolist(), "device": device.tolist(),
                "extra": {str(t.name): t.host_indices.tolist() for t in extra if t.host_indices is not None}}

    def load(self):
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        extra = [PoolTransfer(name=t.name, indices_from_pool=t.indices_from_pool) if t.indices_from_pool
                 else PoolTransfer(name=t.name, host_indices=t.host_indices) for t in self.extra]
        device = self.controller.load(self.host, extra_pools=extra or None)
        if device is None:
            raise RuntimeError("device pool full")
        self.controller.start_loading()
        wait(self.controller.ack_load_queue)
        return {"device": device.tolist(),
                "extra": {str(t.name): t.device_indices.tolist() for t in extra if t.device_indices is not None}}


def wait(acks):
    acks[-1].finish_event.synchronize()
    acks.clear()


def storage_steps(case, entry, host_page):
    """SGLang's L3 storage path on one host pool: pages out, pages in, metadata."""
    host = entry.host_pool
    name = f"storage.{entry.name}"
    index = host_page
    other = (host_page // host.page_size + 1) * host.page_size
    book = lambda: probe.AddressBook(probe.storages(probe.tensors(case.roots)))

    def described(tensor):
        return {"shape": list(tensor.shape), "dtype": str(tensor.dtype), "sha256": probe.tensor_sha256(tensor)}

    pages = {}

    def get_data_page():
        pages["data"] = host.get_data_page(index, flat=True)
        return described(pages["data"])

    def get_dummy():
        pages["dummy"] = host.get_dummy_flat_data_page()
        return {"shape": list(pages["dummy"].shape), "dtype": str(pages["dummy"].dtype)}

    def set_page():
        # A page shaped as get_dummy_flat_data_page says (or get_data_page, where
        # the dummy needs pinned memory this machine lacks), of random bytes.
        like = pages.get("dummy", pages.get("data", torch.empty(16, dtype=torch.uint8)))
        raw = torch.randint(0, 256, (like.numel() * like.element_size(),), generator=case.generator,
                            dtype=torch.uint8)
        host.set_from_flat_data_page(other, raw.view(like.dtype).reshape(like.shape).to(like.device))

    for method, step in (("get_data_page", get_data_page), ("get_dummy_flat_data_page", get_dummy),
                         ("set_from_flat_data_page", set_page)):
        if hasattr(host, method):
            case.record(f"{name}.{method}", step, state=method == "set_from_flat_data_page")
    indices = torch.arange(index, index + host.page_size, dtype=torch.int64)
    for method, args in (("get_page_buffer_meta", (indices,)), ("get_split_heads_page_buffer_meta", (indices, 2)),
                         ("get_contiguous_buf_infos", ()), ("is_stride_page_aligned", ()),
                         ("get_size_per_token", ()), ("get_ksize_per_token", ()), ("available_size", ()),
                         ("get_hybrid_pool_buffer", ())):
        if hasattr(host, method):
            case.record(f"{name}.{method}", lambda m=method, a=args: metadata(getattr(host, m)(*a), book()),
                        state=False)


def metadata(value, book):
    """A method's result with addresses as storage+offset and tensors as their storage."""
    if isinstance(value, torch.Tensor):
        return {"tensor": book.name(value.data_ptr()), "shape": list(value.shape)}
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, int) and not isinstance(v, bool) and v > 1 << 32 for v in value):
            return book.names(value)
        return [metadata(v, book) for v in value]
    return value
