"""The ballast: another process holding GPU memory, so that what the kvcached servers of
a variant (the sharing benchmark) or of a soak's shared phase can map for KV is the
budget, no more: what an operator sharing a GPU with other work would see.

    python -m harness.sharing.ballast --budget BYTES --mapped BYTES --utilization U

kvcached maps a page only while the GPU's free memory stays above its headroom, the total
times (1 - KVCACHED_GPU_UTILIZATION) (kvcached 0.1.6, csrc/page_allocator.cpp,
get_avail_physical_pages; that headroom is what the servers' activations grow into). So,
with the variant's servers up and flushed, their pools holding `mapped` bytes (kvcached's
counters: used and reserved pages), the ballast holds

    held = free - headroom - (budget - mapped)

and the pools can map budget - mapped more: budget in all. It is sized once, when the
variant's turn (the soak's shared phase) begins, and held unchanged until it ends: it
knows nothing of the load. `Holder` starts it from a harness and stops it.

Prints one JSON line (free, total, headroom, held, left_for_kv: bytes) and holds the
memory until its stdin closes or it is terminated. Exit 3 (the JSON has "error") when the
GPU has less free memory than the budget needs. In the CPU tests nothing is allocated:
SHARING_FAKE_GPU="FREE,TOTAL" (bytes) stands in for cudaMemGetInfo; SOAK_FAKE_GPU=TOTAL
for a GPU shared with the soak's stand-in servers (harness/fakes/soak_server.py), whose
memory in use is the records in SOAK_FAKE_SHM (their pages), the ballast's own among them.
"""
from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
from pathlib import Path

from harness import project, servers
from harness.soak import kvc

FAKE = "SHARING_FAKE_GPU"
FAKE_SHARED, FAKE_SHM = "SOAK_FAKE_GPU", "SOAK_FAKE_SHM"


def headroom(total: int, utilization: float) -> int:
    """The free memory kvcached leaves unmapped (its page allocator's headroom)."""
    return int(total * (1.0 - utilization))


def held(free: int, total: int, utilization: float, budget: int, mapped: int) -> int:
    """Bytes the ballast holds so that kvcached can map budget - mapped more (negative:
    the GPU is that much short of the budget)."""
    return free - headroom(total, utilization) - (budget - mapped)


def mem_info() -> tuple[int, int, object]:
    """(free, total, the CUDA module or None) of the current GPU, or the fake's."""
    if fake := os.environ.get(FAKE):
        free, total = (int(float(x)) for x in fake.split(","))
        return free, total, None
    if total := int(os.environ.get(FAKE_SHARED) or 0):
        records = [kvc.read_segment(p) for p in Path(os.environ[FAKE_SHM]).iterdir()]
        return total - sum(r[1] + r[2] for r in records if r), total, None
    import torch

    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    return free, total, torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, required=True, help="the variant's KV budget, bytes")
    ap.add_argument("--mapped", type=int, default=0, help="bytes the variant's pools hold now")
    ap.add_argument("--utilization", type=float, default=0.95, help="KVCACHED_GPU_UTILIZATION of the servers")
    opts = ap.parse_args(argv)
    free, total, torch = mem_info()
    size = held(free, total, opts.utilization, opts.budget, opts.mapped)
    report = {"free": free, "total": total, "headroom": headroom(total, opts.utilization), "budget": opts.budget,
              "mapped": opts.mapped, "held": size}
    if size < 0:
        print(json.dumps({**report, "error": f"the GPU has {free} bytes free: {-size} short of the budget and "
                                             "kvcached's headroom"}), flush=True)
        return 3
    keep = None
    if torch is not None:
        keep = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
    elif os.environ.get(FAKE_SHARED) and not os.environ.get(FAKE):
        keep = Path(os.environ[FAKE_SHM]) / f"ballast{os.getpid()}"
        keep.write_bytes(kvc.RECORD.pack(0, size, 0))
    report["left_for_kv"] = free - (size if torch is None else 0) - report["headroom"]
    print(json.dumps(report), flush=True)
    sys.stdin.read()          # until the harness closes our stdin (or terminates us)
    if isinstance(keep, Path):
        keep.unlink()
    del keep
    return 0


class Holder:
    """The ballast as a harness runs it: one at a time, on one GPU, stopped by closing its
    stdin."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def start(self, python: str, budget: int, mapped: int, utilization: float, gpu: str | None, log: Path,
              timeout: float) -> dict:
        """Start it (`mapped`: what the pools hold now); what it said, with "mapped", and
        with "error" where it holds nothing."""
        command = [python, "-m", "harness.sharing.ballast", "--budget", str(budget), "--mapped", str(mapped),
                   "--utilization", f"{utilization:g}"]
        env = servers.local_env({}, [str(project.ROOT)], gpus=gpu)
        with open(log, "a") as err:
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                                    text=True, start_new_session=True)
        line = ""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if sel.select(timeout=timeout):
                line = proc.stdout.readline()
        try:
            info = json.loads(line)
        except ValueError:
            info = {"error": f"the ballast said nothing it could read ({line.strip()[:200]!r}; {log})"}
        if "error" in info:
            servers.stop(proc, grace=5)
            proc.stdin.close()
            proc.stdout.close()
        else:
            self.proc = proc
        return {"mapped": mapped, **info}

    def stop(self) -> str | None:
        """Stop it; a line saying so where it had exited before (its memory was free again:
        the GPU no longer held the pools to the budget), else None."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        code = proc.poll()
        try:
            proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            servers.stop(proc, grace=5)
        proc.stdout.close()
        return None if code is None else f"the ballast had exited (status {code}) before it was stopped"


if __name__ == "__main__":
    sys.exit(main())
