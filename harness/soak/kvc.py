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
above a server's floor, a lowered limit never takes effect (the first GPU run). A page is
mapped only while the GPU's free memory stays above kvcached's headroom, the total times
(1 - KVCACHED_GPU_UTILIZATION) (harness/sharing/ballast.py).

The shared servers together get a budget B (fixed: what they map after the warm-up and
--budget-fraction of what their pools want beyond it; arbiter: --budget-fraction of what
they want). `Budget` holds them to it in one of two modes (--budget-mode):

  fixed (the default): no controller. Each instance's limit is set once, when the shared
    phase begins, as an operator would set it (`kvctl limit`), and changed only while a
    killed server restarts, when the others are held at what they map (`FixedLimits`; a
    restarted instance writes its full size again and gets the same limit back). Each may grow to B less the other instances' floors (--floor-tokens of
    their tokens; by default --max-cached-tokens, what kvcached keeps of an idle server's
    finished requests), at most to what its pool wants: any one server may take every page
    but those the others keep when idle. Why not less: a limit that binds first leaves the
    pages the GPU has free unused, and nothing would move; why not B: after a flush or a
    restart, one server's burst could map the pages another needs to cache its next
    prefixes. (With three servers, two bursting together can still push the third below
    its floor: the GPU decides then.) The scarcity is the GPU's: a ballast process holds the rest of it, so
    that the servers together can map B and no more, sized once from kvcached's counters
    with the servers warmed up and idle (run.py). An idle server gives pages back only
    through kvcached's cap and SGLang's eviction, and a pool keeps up to
    KVCACHED_MAX_RESERVED_PAGES (10) freed pages mapped in reserve: only the pages beyond
    go back to the GPU, for another server to map (`moves`). The budget starts from
    what the servers hold idle (cached tokens and reserves: an idle server's pages span
    every layer, and kvcached keeps ten of them in reserve) and adds a fifth of the rest of
    what the pools want (--budget-fraction), room for a burst but not for every burst at
    once (at half, the three default models never filled it on an H100: no page moved).
  arbiter: a controller that knows the load (`Arbiter`, the first GPU runs). Every
    instance keeps a floor (--floor-tokens, 6144 by default); the rest of the budget (the
    spare) goes to one live instance at a time, in turn (the one whose clients are in
    their burst), so each instance must give pages back for the other to map them. A
    killed instance leaves the rotation and its floor goes to the others until it is
    back. No ballast: the limits make the scarcity (`reclaims`).
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


MAMBA_GROUP_FIRST = 1000   # kvcached 0.1.6 numbers its Mamba pools' groups from 1000 (ElasticMambaPool)


def is_mamba_segment(segment: str) -> bool:
    """Whether a segment (<name>_g<id>) is a Mamba pool's."""
    group = re.search(r"_g(\d+)$", segment)
    return bool(group) and int(group[1]) >= MAMBA_GROUP_FIRST


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


def floor_bytes(inst: Instance, floor_tokens: int) -> int:
    """An instance's floor: `floor_tokens` of its tokens, at most what its pool wants."""
    return min(inst.want(), int(floor_tokens * inst.bytes_per_token()))


def split(inst: Instance, limit: int) -> dict[str, int]:
    """An instance's limit over its segments in proportion to what they want, but a Mamba
    segment never under what it wants: a limit there can leave SGLang without a Mamba slot,
    and a lowered one unmaps kvcached's reserve (`FixedLimits.hold`). Where a hybrid's
    limit is under what it wants, its segments together may then exceed it by that much."""
    return {seg: want if is_mamba_segment(seg) else limit * want // inst.want() for seg, want in inst.wants.items()}


def write_split(shm_dir: str, inst: Instance, limit: int) -> list[tuple[str, int]]:
    """An instance's limit, split over its segments (`split`), written where a segment
    holds another; the (segment, bytes) written."""
    return write_segments(shm_dir, split(inst, limit))


def write_segments(shm_dir: str, limits: dict[str, int]) -> list[tuple[str, int]]:
    """Each segment's limit written where it holds another; the (segment, bytes) written."""
    written = []
    for seg, limit in limits.items():
        rec = read_segment(os.path.join(shm_dir, seg))
        if rec is not None and rec[0] != limit and write_limit(os.path.join(shm_dir, seg), limit):
            written.append((seg, limit))
    return written


class FixedLimits:
    """Each instance's limit, fixed when made: the budget less the other instances'
    floors, at most what its pool wants (the module docstring says why). `apply` writes
    it where a segment holds another limit (at first, and after a restart, where kvcached
    wrote the pool's full size again), or a `hold`'s; `writes` logs every write.
    With the soak's three tiny models only the largest pool's limit is under what it
    wants: the GPU (the ballast) does nearly all the holding. While a killed server is
    down, the others' KV pools are held at what they map (`hold`): what it freed is its
    restart's."""

    def __init__(self, shm_dir: str, instances: list[Instance], budget: int, floor_tokens: int):
        self.shm_dir, self.instances = shm_dir, instances
        self.floors = floors = {i.name: floor_bytes(i, floor_tokens) for i in instances}
        self.limits = {i.name: max(0, min(i.want(), budget - sum(floors.values()) + floors[i.name]))
                       for i in instances}
        self.writes: list[tuple[str, int]] = []
        self.held: dict[str, int] = {}          # segment -> bytes, while `hold` lasts
        self.readings: dict[str, dict] = {}     # segment -> its counters when the hold began

    def hold(self, instances: list[Instance]) -> dict[str, int]:
        """Hold each KV segment of these instances at what it maps now (pages in use and in
        reserve; at least its share of the floor) until `release`: while a killed server
        restarts, so that the others cannot map what its process freed, which its CUDA
        context, weights and graphs take again outside kvcached (whose headroom would then
        keep its pool from starting). A Mamba segment keeps its limit: SGLang 0.5.20 asserts
        when kvcached cannot give it a Mamba slot, and a hybrid held at what it mapped at the
        kill died that way (results/2026-12-07-h100-soak-three.json; docs/upstream.md).
        Returns the bytes held per server; `readings` keeps what each segment read then."""
        self.held, self.readings = {}, {}
        for inst in instances:
            for seg, want in inst.wants.items():
                rec = read_segment(os.path.join(self.shm_dir, seg))
                if rec is None:
                    continue
                self.held[seg] = rec[0] if is_mamba_segment(seg) else \
                    max(self.floors[inst.name] * want // inst.want(), rec[1] + rec[2])
                self.readings[seg] = {"limit": rec[0], "used": rec[1], "prealloc": rec[2], "held": self.held[seg]}
        self.apply()
        return {i.server: sum(self.held.get(seg, 0) for seg in i.wants) for i in instances}

    def release(self) -> None:
        self.held = {}
        self.apply()

    def apply(self) -> dict[str, int]:
        for inst in self.instances:
            if not inst.wants:  # known once the instance (or its restart) wrote its segments
                continue
            if held := {seg: self.held[seg] for seg in inst.wants if seg in self.held}:
                self.writes += write_segments(self.shm_dir, held)
            else:
                self.writes += write_split(self.shm_dir, inst, self.limits[inst.name])
        return self.limits


class Arbiter:
    """Splits a total budget (bytes) over live instances: floors for all, the spare to the
    one named by `boosted`; writes the limits where they differ from what is set."""

    def __init__(self, shm_dir: str, instances: list[Instance], budget: int, floor_tokens: int):
        self.shm_dir, self.instances, self.budget, self.floor_tokens = shm_dir, instances, budget, floor_tokens

    def floor(self, inst: Instance) -> int:
        return floor_bytes(inst, self.floor_tokens)

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
        """Write the plan's limits (`write_split`; a restarted instance's full size set
        back); returns the plan."""
        limits = self.plan(boosted)
        for inst in self.instances:
            if inst.name in limits:
                write_split(self.shm_dir, inst, limits[inst.name])
        return limits


class Budget:
    """A fleet's kvcached instances (fleet.Fleet), its budget and its counter samples."""

    def __init__(self, fleet, shm_dir: str, max_total_tokens: int, burst_period: float, mode: str = "fixed"):
        self.fleet, self.shm_dir, self.burst_period, self.mode = fleet, shm_dir, burst_period, mode
        self.instances: dict[str, Instance] = {}
        for s in fleet.servers.values():
            if s.kvcached:
                remove_segments(shm_dir, s.ipc_name)
                self.instances[s.ipc_name] = Instance(s.ipc_name, s.label, max_total_tokens)
        self.shared: list[Instance] = []         # the shared servers' instances, once share() ran
        self.arbiter: Arbiter | None = None
        self.limits: FixedLimits | None = None
        self.lock = threading.Lock()

    def instance(self, server) -> Instance:
        return self.instances[server.ipc_name]

    def read(self, server) -> dict | None:
        return read_instance(self.shm_dir, self.instance(server))

    def lost(self, server) -> None:
        """A server died: its instance leaves the rotation until it is back."""
        if server.kvcached and server.ipc_name in self.instances:
            self.instances[server.ipc_name].live = False

    def share(self, shared: list, fraction: float, floor_tokens: int, mapped: int = 0) -> dict:
        """Put the shared servers under one budget: what they map now (`mapped`, bytes:
        idle, kvcached keeps pages in reserve and its pages span every layer) and
        `fraction` of what their pools want beyond that, so that the budget leaves room to
        grow however much an idle server keeps. Fixed limits written (mode fixed) or the
        arbiter made (mode arbiter); returns the mode, the budget, the wants, the floors
        and the fixed limits (bytes)."""
        for s in shared:   # wants known from the first read of each instance's segments
            self.read(s)
        insts = self.shared = [self.instance(s) for s in shared]
        wants = sum(i.want() for i in insts)
        budget = mapped + int(fraction * max(0, wants - mapped))
        out = {"budget_mode": self.mode, "budget_bytes": budget, "wants_bytes": {i.server: i.want() for i in insts},
               "floors_bytes": {i.server: floor_bytes(i, floor_tokens) for i in insts}, "mapped_at_start_bytes": mapped}
        if self.mode == "arbiter":
            self.arbiter = Arbiter(self.shm_dir, insts, budget, floor_tokens)
        else:
            self.limits = FixedLimits(self.shm_dir, insts, budget, floor_tokens)
            self.limits.apply()
            out["limits_bytes"] = {i.server: self.limits.limits[i.name] for i in insts}
        return out

    def sample(self) -> None:
        """kvcached's counters of every instance, the limits applied first: the arbiter's
        for the burst window's server, or the fixed ones where a restart reset them. The
        burst window (Fleet.boosted) moves on in either mode: the load follows it."""
        with self.lock:
            fleet = self.fleet
            if fleet.shared_t0 is not None:
                live = [s.label for s in fleet.shared() if s.up.is_set()]
                fleet.boosted = burst_owner(time.time() - fleet.shared_t0, self.burst_period, live)
            if self.arbiter:
                self.arbiter.apply(fleet.servers[fleet.boosted].ipc_name if fleet.boosted else None)
            elif self.limits:
                self.limits.apply()
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
            except Exception as exc:      # noqa: BLE001 -- a sampler that dies leaves the limits unwritten
                self.fleet.journal.write({"type": "note", "what": f"sampling failed: {type(exc).__name__}: {exc}"})

    def limits_mib(self) -> str:
        """The progress line's: the shared instances' limits (arbiter) or mapped bytes, MiB."""
        mib = lambda c: ((c["limit"] if self.arbiter else mapped(c)) >> 20) if c else 0
        return f"{'limit' if self.arbiter else 'mapped'} MiB " + ", ".join(
            f"{i.server}={mib(read_instance(self.shm_dir, i))}" for i in self.shared)

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
    (one page bundle) is one reclaim (`pair`). Returns the count, the bytes moved and,
    per "giver->taker", the bytes."""
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
    return pair(falls, rises, min_bytes, window)


def moves(samples: list[dict], budget: int, min_bytes: int, window: float = 10.0, full: float = 0.95) -> dict:
    """Pages one instance gave back and another mapped while the budget was full, from
    counter samples alone (the fixed mode: no limit moves, the GPU holds the budget).

    samples: as `reclaims` takes them. Between two samples each live shared instance's
    mapped bytes (`mapped`) fall or rise. A fall is the instance giving pages back (its
    cap on cached tokens, SGLang's eviction, requests ending). Of a rise, the part above
    the instance's highest level of the `window` s before is taken, but only where the
    instances together then map at least `full` of the budget: pages were scarce, so it
    could map them only because another gave them back (a server refilling what it held a moment ago, or growing into free pages, is
    neither). Falls and taken parts are matched as in `reclaims`, but a taken part only
    with a fall seen in the same interval between two samples or before it;
    a fall matched with at least min_bytes is one reclaim, its bytes moved the smaller of
    the fall and what was taken. Returns what `reclaims` returns."""
    falls, rises = [], []            # [t, instance, bytes (left to match)]
    levels: dict[str, deque] = {}    # instance -> (t, mapped) of the last `window` s
    for before, after in zip(samples, samples[1:]):
        a, b = before["instances"], after["instances"]
        total = sum(mapped(c) for c in b.values() if under_budget(c))
        for n in (n for n in a if n in b and under_budget(a[n]) and under_budget(b[n])):
            was, now = mapped(a[n]), mapped(b[n])
            recent = levels.setdefault(n, deque())
            recent.append((before["t"], was))
            while len(recent) > 1 and recent[0][0] < after["t"] - window:
                recent.popleft()
            taken = now - max(lv for _, lv in recent)
            if now < was:
                falls.append([after["t"], n, was - now])
            elif taken > 0 and total >= full * budget:
                rises.append([after["t"], n, taken])
    return pair(falls, rises, min_bytes, window, not_before=0.0)


def pair(falls: list[list], rises: list[list], min_bytes: int, window: float,
         not_before: float | None = None) -> dict:
    """Each fall [t, giver, bytes] matched with other instances' rises [t, taker, bytes]
    less than `window` s before or after it (not_before: no more than that many s before
    it), each rise's bytes matched once, oldest first; a fall matched with at least
    min_bytes is one reclaim. Returns the count, the bytes moved and, per "giver->taker",
    the bytes."""
    count, moved, pairs = 0, 0, {}
    for t, giver, amount in falls:
        takes = []                   # (rise, bytes): kept only if the fall is a reclaim
        for rise in rises:
            left = amount - sum(n for _, n in takes)
            if not left:
                break
            if rise[1] != giver and rise[2] and abs(rise[0] - t) <= window and (
                    not_before is None or rise[0] >= t - not_before):
                takes.append((rise, min(left, rise[2])))
        matched = sum(n for _, n in takes)
        if matched < min_bytes:
            continue
        count, moved = count + 1, moved + matched
        for rise, n in takes:
            rise[2] -= n
            pairs[f"{giver}->{rise[1]}"] = pairs.get(f"{giver}->{rise[1]}", 0) + n
    return {"count": count, "bytes": moved, "pairs": pairs}
