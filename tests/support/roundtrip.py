"""One round-trip checker for every pool kind, used by the CPU and GPU tiers.

A trip backs up random pages (slots, for Mamba) of a device pool to random host pages
through the host pool's own ``backup_from_device_all_layer``, then loads them layer by
layer into other random device pages through ``load_to_device_per_layer``. The checks
are on content (Expected): host rows equal the device rows backed up, rows loaded back
equal the originals byte for byte, and at the end no other device row in use and no host
row changed. Every byte starts out random, so a stray write or a wrong stride shows.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

import torch

from harness.emulation.allocators import pages_to_rows


@dataclass
class Rows:
    """A family of per-layer tensors (K, V, KV, or one Mamba state) on both sides.

    device: layer l's device view, indexed by device row (token or slot).
    host:   returns layer l's host image, indexed by host row (may be a copy).
    """

    name: str
    device: list[torch.Tensor]
    host: Callable[[int], torch.Tensor]


def host_layer_rows(host, layer_refs, buffer_index=None):
    """Layer l's host rows, indexed by host token, whatever the host pool's layout."""
    if host.layout == "page_first_direct":  # (pages, layers, page, ...): a copy
        buffer = host.kv_buffer if buffer_index is None else host.kv_buffer[buffer_index]
        return lambda l: buffer[:, l].reshape(-1, *buffer.shape[3:])
    return lambda l: layer_refs[l]


def mha_families(pool, host):
    return [Rows("K", pool.k_buffer, host_layer_rows(host, host.k_data_refs, 0)),
            Rows("V", pool.v_buffer, host_layer_rows(host, host.v_data_refs, 1))]


def mla_families(pool, host):
    return [Rows("KV", pool.kv_buffer, host_layer_rows(host, host.data_refs))]


def mamba_families(pool, host):
    """Per state (temporal, each conv), every layer's device view and its host image."""
    states = [pool.mamba_cache.at_layer_idx(l) for l in range(pool.num_mamba_layers)]
    families = [Rows("temporal", [s.temporal for s in states], lambda l: host.temporal_buffer[:, l, 0])]
    for i in range(len(states[0].conv)):
        families.append(Rows(f"conv{i}", [s.conv[i] for s in states], lambda l, i=i: host.conv_buffer[i][:, l, 0]))
    return families


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's rows as raw bytes: (rows, bytes_per_row)."""
    tensor = tensor.contiguous()
    return tensor.view(torch.uint8).reshape(tensor.shape[0], -1)


def random_rows(like: torch.Tensor, rows: int, generator: torch.Generator) -> torch.Tensor:
    """Random bytes shaped like `rows` rows of `like` (any bit pattern: we compare bytes)."""
    nbytes = rows * like[0].numel() * like.element_size()
    raw = torch.randint(0, 256, (nbytes,), generator=generator, dtype=torch.uint8)
    return raw.view(like.dtype).reshape(rows, *like.shape[1:])


def fill_random(families: list[Rows], used: torch.Tensor, generator: torch.Generator):
    for family in families:
        for view in family.device:
            view[used.to(view.device)] = random_rows(view, used.numel(), generator).to(view.device)


def poison(tensor: torch.Tensor, generator: torch.Generator):
    flat = tensor.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, generator=generator, dtype=torch.uint8).to(flat.device))


class Expected:
    """What each device row in `rows` and each host row should hold, per family and layer."""

    def __init__(self, families: list[Rows], rows: torch.Tensor):
        self.families, self.rows = families, rows
        self.index = {row: i for i, row in enumerate(rows.tolist())}
        self.device = [[as_bytes(v[rows.to(v.device)]).clone() for v in f.device] for f in families]
        self.host = [[as_bytes(f.host(l)).clone() for l in range(len(f.device))] for f in families]

    def _positions(self, rows):
        return torch.tensor([self.index[r] for r in rows.tolist()])

    def check_backup(self, host_rows, src_rows):
        host_rows, src = host_rows.cpu(), self._positions(src_rows)
        for family, expected, host_model in zip(self.families, self.device, self.host):
            for layer in range(len(family.device)):
                original = expected[layer][src.to(expected[layer].device)].cpu()
                assert torch.equal(as_bytes(family.host(layer)[host_rows]), original), (
                    f"{family.name} layer {layer}: host rows differ from the device rows backed up")
                host_model[layer][host_rows] = original

    def check_load(self, src_rows, dst_rows):
        src, dst = self._positions(src_rows), self._positions(dst_rows)
        for family, expected in zip(self.families, self.device):
            for layer, view in enumerate(family.device):
                original = expected[layer][src.to(expected[layer].device)]
                assert torch.equal(as_bytes(view[dst_rows.to(view.device)]), original), (
                    f"{family.name} layer {layer}: rows loaded back differ from the originals")
                expected[layer][dst.to(expected[layer].device)] = original

    def check_untouched(self):
        for family, expected, host_model in zip(self.families, self.device, self.host):
            for layer, view in enumerate(family.device):
                assert torch.equal(as_bytes(view[self.rows.to(view.device)]), expected[layer]), (
                    f"{family.name} layer {layer}: device rows no trip targeted changed")
                assert torch.equal(as_bytes(family.host(layer)), host_model[layer]), (
                    f"{family.name} layer {layer}: host rows no trip targeted changed")


class RoundTrip:
    """Runs trips over one (device pool, host pool) pair and keeps the expected model.

    backup(host_rows, device_rows) and load(host_rows, device_rows, layer) call the host
    pool the way SGLang's cache controller does (indices on the devices it uses).
    """

    def __init__(self, families, used_pages, host_pages, page_size, num_layers,
                 backup, load, *, seed=0, max_pages=4, host_runs=False, device="cuda"):
        self.page_size, self.num_layers = page_size, num_layers
        self.used_pages, self.host_pages = list(used_pages), list(host_pages)
        self.backup, self.load, self.device = backup, load, device
        self.max_pages, self.host_runs = max_pages, host_runs
        self.rng = random.Random(seed)
        self.expected = Expected(families, pages_to_rows(self.used_pages, page_size))

    def _sync(self):
        if self.device != "cpu":
            torch.cuda.synchronize()

    def pick_host_pages(self, n):
        if not self.host_runs:
            return self.rng.sample(self.host_pages, n)
        # SGLang's host allocator hands out free pages in order: a run of consecutive host
        # pages (host_pages must be a range), cut at a random point with the two pieces
        # swapped, so a backup holds one run or two with a step back between them.
        start = self.rng.randrange(len(self.host_pages) - n + 1)
        run = self.host_pages[start:start + n]
        cut = self.rng.randrange(n)
        return run[cut:] + run[:cut]

    def trip(self):
        n = self.rng.randint(1, self.max_pages)
        chosen = self.rng.sample(self.used_pages, 2 * n)
        src = pages_to_rows(chosen[:n], self.page_size)
        dst = pages_to_rows(chosen[n:], self.page_size)
        hst = pages_to_rows(self.pick_host_pages(n), self.page_size)
        self.backup(hst, src.to(self.device))
        self._sync()
        self.expected.check_backup(hst, src)
        for layer in range(self.num_layers):
            self.load(hst, dst.to(self.device), layer)
        self._sync()
        self.expected.check_load(src, dst)

    def run(self, trips: int):
        for _ in range(trips):
            self.trip()
        self.expected.check_untouched()
