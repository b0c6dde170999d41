"""kvcached 0.1.6's per-instance counters, a shared KV budget over them, and reclaims.

Each SGLang server with kvcached on is one kvcached instance, named by KVCACHED_IPC_NAME.
Each of its elastic pools keeps a record in a shared-memory file, /dev/shm/<name> (the
pool of kvcached group 0; MLA pools and the first MHA pool land there) or
/dev/shm/<name>_g<id> (a pool of group <id> given its own segment: SWA and Mamba pools),
holding three native int64: `total_size` (the pool's limit in bytes, all layers and K/V
buffers; kvcached writes the pool's full virtual size when the pool starts), `used_size`
(bytes of pages in use) and `prealloc_size` (bytes of mapped pages kept in reserve). The
file is locked with flock, shared to read and exclusive to write (kvcached's
`cli/utils.py` RwLockedShm, `kvctl list`/`kvctl limit`). A changed `total_size` is picked up
by the pool's resize watcher (every 100 ms) and applied at its next allocation: a larger
limit at once, a smaller one as soon as the pages in use fit under it ("deferred" until
then; meanwhile the pool reports no free page, so SGLang evicts what each request needs and
no more). The tokens in use are the running requests' and the finished ones' SGLang keeps
cached, up to KVCACHED_MAX_CACHED_TOKENS (kvcached's cap, 16000 by default): with that cap
above a server's floor, a lowered limit never takes effect (the first GPU run).

The GPU itself is far larger than the tiny models need, so the scarcity a soak run needs
is made with these limits, kvcached's own control for several models on one GPU: a total
budget smaller than what the servers' pools want (`Arbiter`). Every instance keeps a floor;
the rest of the budget (the spare) goes to one live instance at a time, in turn (the one
whose clients are in their burst), so each instance must give pages back for the other to
map them. A killed instance leaves the rotation and its floor goes to the others until it
is back. `reclaims` reads the counters only: pages kvcached took back from an instance
above its lowered limit that another then mapped above its own earlier limit. `Budget`
runs it in a soak: the instances of a fleet's kvcached servers, the arbiter of the shared
phase, and the counter samples it journals (the limits applied first).
"""
from __future__ import annotations

import fcntl
import os
import re
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from harness.soak.traffic import burst_owner

RECORD = struct.Struct("=qqq")        # total_size, used_size, prealloc_size (kvcached's MemInfoStruct)
SHM_DIR = "/dev/shm"


def segment_names(shm_dir: str, name: str) -> list[str]:
    """The segments of instance `name`: `name` itself and `name_g<id>`, sorted."""
    pattern = re.compile(re.escape(name) + r"(_g\d+)?")
    try:
        entries = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if pattern.fullmatch(e))


def read_segment(path: str | Path) -> tuple[int, int, int] | None:
    """(limit, used, prealloc) bytes of one segment; None if it is gone or short."""
    try:
        with open(path, "rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)
            data = handle.read(RECORD.size)
    except (FileNotFoundError, PermissionError):
        return None
    return RECORD.unpack(data) if len(data) == RECORD.size else None


def write_limit(path: str | Path, limit: int) -> bool:
    """Set a segment's limit (total_size), leaving used/prealloc as they are."""
    try:
        with open(path, "r+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            data = handle.read(RECORD.size)
            if len(data) != RECORD.size:
                return False
            _, used, prealloc = RECORD.unpack(data)
            handle.seek(0)
            handle.write(RECORD.pack(int(limit), used, prealloc))
            handle.flush()
    except (FileNotFoundError, PermissionError):
        return False
    return True


def remove_segments(shm_dir: str, name: str) -> list[str]:
    """Delete the segments a killed instance left behind (kvctl delete does the same);
    returns the names removed."""
    removed = []
    for seg in segment_names(shm_dir, name):
        try:
            os.unlink(os.path.join(shm_dir, seg))
            removed.append(seg)
        except FileNotFoundError:
            pass
    return removed


def mapped_bytes(shm_dir: str, names) -> int:
    """Bytes the named instances have mapped (pages in use and in reserve, every segment)."""
    total = 0
    for name in names:
        for seg in segment_names(shm_dir, name):
            rec = read_segment(os.path.join(shm_dir, seg))
            if rec:
                total += rec[1] + rec[2]
    return total


@dataclass
class Instance:
    """One kvcached instance (one server) under the budget."""
    name: str                  # KVCACHED_IPC_NAME
    server: str                # the server's label in the run
    max_total_tokens: int      # its --max-total-tokens: what the pool wants
    live: bool = True
    wants: dict[str, int] = field(default_factory=dict)   # segment -> limit kvcached set at start

    def want(self) -> int:
        return sum(self.wants.values())

    def bytes_per_token(self) -> float:
        return self.want() / self.max_total_tokens if self.wants else 0.0


def read_instance(shm_dir: str, inst: Instance) -> dict | None:
    """Current counters of an instance, summed over its segments; None before it has one.
    A segment seen for the first time has its start limit recorded as what it wants."""
    limit = used = prealloc = 0
    segs = {}
    for seg in segment_names(shm_dir, inst.name):
        rec = read_segment(os.path.join(shm_dir, seg))
        if rec is None:
            continue
        if seg not in inst.wants and rec[0] > 0:
            inst.wants[seg] = rec[0]
        segs[seg] = rec
        limit, used, prealloc = limit + rec[0], used + rec[1], prealloc + rec[2]
    if not segs:
        return None
    return {"limit": limit, "used": used, "prealloc": prealloc, "segments": len(segs)}


class Arbiter:
    """Splits a total budget (bytes) over live instances: floors for all, the spare to the
    one named by `boosted`; writes the limits where they differ from what is set."""

    def __init__(self, shm_dir: str, instances: list[Instance], budget: int, floor_tokens: int):
        self.shm_dir, self.instances, self.budget, self.floor_tokens = shm_dir, instances, budget, floor_tokens
        self.written: dict[str, int] = {}    # segment -> last limit written

    def floor(self, inst: Instance) -> int:
        return min(inst.want(), int(self.floor_tokens * inst.bytes_per_token()))

    def plan(self, boosted: str | None) -> dict[str, int]:
        """Instance name -> limit (bytes): the live ones with known wants only."""
        live = [i for i in self.instances if i.live and i.wants]
        limits = {i.name: self.floor(i) for i in live}
        spare = self.budget - sum(limits.values())
        order = sorted(live, key=lambda i: i.name != boosted)   # the boosted one first
        for inst in order:
            if spare <= 0:
                break
            extra = min(spare, inst.want() - limits[inst.name])
            limits[inst.name] += extra
            spare -= extra
        return limits

    def apply(self, boosted: str | None) -> dict[str, int]:
        """Write the plan's limits, each split over the instance's segments in proportion
        to what they want; returns the plan."""
        limits = self.plan(boosted)
        for inst in self.instances:
            if inst.name not in limits:
                continue
            total_want = inst.want()
            for seg, want in inst.wants.items():
                share = limits[inst.name] * want // total_want
                if self.written.get(seg) != share or self._differs(seg, share):
                    if write_limit(os.path.join(self.shm_dir, seg), share):
                        self.written[seg] = share
        return limits

    def _differs(self, seg: str, share: int) -> bool:
        """A restarted instance writes its full size again: set it back."""
        rec = read_segment(os.path.join(self.shm_dir, seg))
        return rec is not None and rec[0] != share


class Budget:
    """A fleet's kvcached instances (fleet.Fleet), its budget and its counter samples."""

    def __init__(self, fleet, shm_dir: str, max_total_tokens: int, burst_period: float):
        self.fleet, self.shm_dir, self.burst_period = fleet, shm_dir, burst_period
        self.instances: dict[str, Instance] = {}
        for s in fleet.servers.values():
            if s.kvcached:
                remove_segments(shm_dir, s.ipc_name)
                self.instances[s.ipc_name] = Instance(s.ipc_name, s.label, max_total_tokens)
        self.arbiter: Arbiter | None = None
        self.lock = threading.Lock()

    def instance(self, server) -> Instance:
        return self.instances[server.ipc_name]

    def read(self, server) -> dict | None:
        return read_instance(self.shm_dir, self.instance(server))

    def lost(self, server) -> None:
        """A server died: its instance leaves the rotation until it is back."""
        if server.kvcached and server.ipc_name in self.instances:
            self.instances[server.ipc_name].live = False

    def share(self, shared: list, fraction: float, floor_tokens: int) -> dict:
        """Put the shared servers under one budget, `fraction` of what their pools want;
        returns the budget, the wants and the floors (bytes)."""
        for s in shared:   # wants known from the first read of each instance's segments
            self.read(s)
        insts = [self.instance(s) for s in shared]
        want = sum(i.want() for i in insts)
        budget = int(fraction * want)
        self.arbiter = Arbiter(self.shm_dir, insts, budget, floor_tokens)
        return {"budget_bytes": budget, "wants_bytes": {i.server: i.want() for i in insts},
                "floors_bytes": {i.server: self.arbiter.floor(i) for i in insts}}

    def sample(self) -> None:
        """kvcached's counters of every instance; the arbiter's limits applied first."""
        with self.lock:
            fleet = self.fleet
            if self.arbiter:
                live = [s.label for s in fleet.shared() if s.up.is_set()]
                if fleet.shared_t0 is not None:
                    fleet.boosted = burst_owner(time.time() - fleet.shared_t0, self.burst_period, live)
                self.arbiter.apply(fleet.servers[fleet.boosted].ipc_name if fleet.boosted else None)
            counters = {}
            for s in fleet.servers.values():
                if not s.kvcached or s.ipc_name not in self.instances:
                    continue
                inst = self.instances[s.ipc_name]
                c = read_instance(self.shm_dir, inst)
                if c is not None:
                    counters[s.label] = {**c, "live": inst.live and s.up.is_set(), "role": s.role}
            fleet.journal.write({"type": "sample", "instances": counters, "boosted": fleet.boosted})

    def sampler(self, every: float) -> None:
        while not self.fleet.stopping.wait(every):
            try:
                self.sample()
            except OSError as exc:
                self.fleet.journal.write({"type": "note", "what": f"sampling failed: {exc}"})

    def limits_mib(self) -> str:
        return ", ".join(f"{i.server}={(read_instance(self.shm_dir, i) or {}).get('limit', 0) >> 20}"
                         for i in self.instances.values())

    def clear(self) -> None:
        """The segments the instances leave behind."""
        for name in self.instances:
            remove_segments(self.shm_dir, name)


def mapped(counters: dict) -> int:
    """Bytes an instance has mapped: pages in use and pages kept in reserve."""
    return counters["used"] + counters.get("prealloc", 0)


def under_budget(counters: dict) -> bool:
    """A live shared instance (the unshared references are not under the budget)."""
    return counters.get("live", True) and counters.get("role", "shared") == "shared"


def reclaims(samples: list[dict], min_bytes: int, window: float = 10.0) -> dict:
    """Pages the budget took from one instance and another then mapped, from counter samples.

    samples: {"t": seconds, "instances": {name: {"limit": bytes, "used": bytes, "prealloc":
    bytes, "live": bool, "role": str}}} in time order; instances of another role than
    "shared" (the unshared references) are left out. The arbiter writes the limits before
    it reads the counters, so the limit read with a sample is the one in force until the
    next. Between two samples each live instance's mapped bytes (`mapped`) rise or fall.
    Of a fall, the part above the limit in force is forced: kvcached took those pages back
    for the budget (the rest is the instance's own shrinkage). Of a rise, the part above
    the instance's lowest limit of the `window` s before is taken: it could map those pages
    only because the budget moved to it. A forced part is matched with other instances'
    taken parts less than `window` s before or after it (the order varies: a raised limit
    is taken at once, a lowered one once the pages in use fit under it), each taken part
    matched once, oldest first; a forced part whose matched amount is at least min_bytes
    (one page bundle) is one reclaim. Returns the count, the bytes moved and, per
    "giver->taker", the bytes."""
    falls, rises = [], []            # [t, instance, bytes (left to match)]
    limits: dict[str, deque] = {}    # instance -> (t, limit in force from t), the last `window` s
    for before, after in zip(samples, samples[1:]):
        a, b = before["instances"], after["instances"]
        for n, c in a.items():
            recent = limits.setdefault(n, deque())
            recent.append((before["t"], c["limit"]))
            while len(recent) > 1 and recent[0][0] < after["t"] - window:   # the one in force stays
                recent.popleft()
        for n in (n for n in a if n in b and under_budget(a[n]) and under_budget(b[n])):
            was, now = mapped(a[n]), mapped(b[n])
            taken = now - max(was, min(lim for _, lim in limits[n]))
            forced = min(was - now, was - a[n]["limit"])
            if taken > 0:
                rises.append([after["t"], n, taken])
            elif forced > 0:
                falls.append([after["t"], n, forced])
    count, moved, pairs = 0, 0, {}
    for t, giver, amount in falls:
        takes = []                   # (rise, bytes): kept only if the fall is a reclaim
        for rise in rises:
            left = amount - sum(n for _, n in takes)
            if not left:
                break
            if rise[1] != giver and rise[2] and abs(rise[0] - t) <= window:
                takes.append((rise, min(left, rise[2])))
        matched = sum(n for _, n in takes)
        if matched < min_bytes:
            continue
        count, moved = count + 1, moved + matched
        for rise, n in takes:
            rise[2] -= n
            pairs[f"{giver}->{rise[1]}"] = pairs.get(f"{giver}->{rise[1]}", 0) + n
    return {"count": count, "bytes": moved, "pairs": pairs}
