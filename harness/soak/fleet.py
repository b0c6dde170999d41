"""The soak's fleet: its servers (launched, watched, killed, restarted) and its journal.

Servers (SGLang 0.5.20's `python -m sglang.launch_server`, side by side, with the
interpreter and environment of the caller, `--enable-hierarchical-cache` on every one):
  shared s0, s1[, s2]  one per model, kvcached on (ENABLE_KVCACHED=true, each its own
                       KVCACHED_IPC_NAME), all on one GPU under one KV budget (kvc);
                       the last one runs --small-host-ratio when it is set;
  ref-native-<model>   kvcached off, unshared: the oracle's solo answers, then the reference load;
  ref-kvcached-<model> kvcached on, unshared (no limit set): the reference load.
`Fleet` holds them with what every part of a run reads: the journal, the stop events,
the shared phase's start and whose burst window it is.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from harness import servers
from harness.compare import matrix
from harness.compare import verdict as judge

class Journal:
    """Events, one JSON object a line, on disk at once (the file opened for each); thread-safe."""

    def __init__(self, path: Path, started: float):
        self.path, self.started = path, started
        self.lock = threading.Lock()

    def now(self) -> float:
        return round(time.time() - self.started, 3)

    def write(self, event: dict) -> dict:
        event = {"t": self.now(), **event}
        with self.lock, open(self.path, "a") as handle:
            handle.write(json.dumps(event) + "\n")
        return event


class FleetServer(servers.Server):
    """One server of the fleet: what it is for, whether clients may send to it."""

    def __init__(self, command: list[str], port: int, log: Path, env: dict[str, str], process_env: dict[str, str],
                 *, label: str, role: str, case: matrix.Case, kvcached: bool, ipc_name: str | None):
        super().__init__(command, port, log, env, process_env)
        self.label, self.role, self.case, self.kvcached, self.ipc_name = label, role, case, kvcached, ipc_name
        self.up = threading.Event()           # answering; clients wait while it is not
        self.paused = threading.Event()       # clients hold back (a drained flush)
        self.expect_exit = False              # a kill or stop by the harness
        self.inflight = 0
        self.lock = threading.Lock()

    @property
    def generation(self) -> int:
        """Starts so far."""
        return self.starts

    def launch(self, journal: Journal) -> None:
        started = self.start(f"\n===== soak: start {self.starts + 1} =====")
        # only now: until the new process stands in self.process, the watcher must not take
        # the killed one's exit for a crash
        self.expect_exit = False
        journal.write({"type": "server", "event": "launched" if started else "not started",
                       **({} if started else {"why": self.taken}), "server": self.label, "role": self.role,
                       "model": self.case.name, "pool": self.case.pool, "kvcached": self.kvcached,
                       "ipc_name": self.ipc_name, "port": self.port, "command": self.command, "env": self.env,
                       "log": str(self.log), "generation": self.generation})

    def wait_up(self, journal: Journal, timeout: float) -> bool:
        began = time.time()
        why = self.wait_ready(timeout)
        if why:
            journal.write({"type": "server", "event": "not ready", "server": self.label, "why": why,
                           **judge.scan_log(self.log_text())})
            return False
        self.up.set()
        scan = judge.scan_log(self.log_text())
        journal.write({"type": "server", "event": "ready", "server": self.label, "generation": self.generation,
                       "start_s": round(time.time() - began, 1), "weights_redrawn": scan["weights_redrawn"],
                       "kvcached_lines": len(scan["kvcached_lines"])})
        return True

    def kill9(self) -> None:
        self.expect_exit = True
        self.up.clear()
        self.kill()

    def stop(self, grace: float = 30) -> None:
        self.expect_exit = True
        self.up.clear()
        super().stop(grace)


# kvcached keeps min(its pool's pages, this) mapped in reserve: a pool mapped whole
WHOLE_POOL_PAGES = 1 << 20


def build(opts, cases: list[matrix.Case], logs: Path) -> tuple[dict[str, FleetServer], str | None]:
    """The fleet's servers, by label, and the label of the one with the small host pool."""
    o = opts
    specs = [(f"s{i}", "shared", case, True) for i, case in enumerate(cases)]
    if not o.no_reference:
        for case in dict.fromkeys(cases):
            specs.append((f"ref-native-{case.name}", "ref-native", case, False))
            specs.append((f"ref-kvcached-{case.name}", "ref-kvcached", case, True))
    base = o.port or servers.free_port_block(len(specs))
    extra_flags = [f for chunk in o.server_flags for f in chunk.split()]
    if not o.no_deterministic:
        extra_flags.append("--enable-deterministic-inference")
    extra_env = servers.parse_env(o.env)
    # deep_gemm, which SGLang's DeepSeek model file imports: the stand-in where it is missing
    deep_gemm = any(c.pool == "mla" for c in cases) and servers.lacks(o.python, "deep_gemm")
    tag = f"soak{os.getpid() % 100000}"
    fleet, small_host = {}, None
    for i, (label, role, case, on) in enumerate(specs):
        port = base + 10 * i
        small = role == "shared" and label == f"s{len(cases) - 1}" and o.small_host_ratio
        plan = matrix.Plan(device_tokens=o.max_total_tokens,
                           hicache_ratio=o.small_host_ratio if small else o.hicache_ratio)
        variant = matrix.ELASTIC["contiguous"] if on else matrix.NATIVE
        row = matrix.Row(case, matrix.HOST_LAYOUTS[0], False, variant, "match")
        args = matrix.server_args(row, port, plan, [*extra_flags, "--nccl-port", str(port + 1)])
        env = {**extra_env, **matrix.server_env(row)}
        ipc = None
        if on:
            ipc = f"{tag}_{label}".replace(".", "-")
            env["KVCACHED_IPC_NAME"] = ipc
            env["KVCACHED_MAX_CACHED_TOKENS"] = str(o.max_cached_tokens)
            env["KVCACHED_GPU_UTILIZATION"] = f"{o.gpu_utilization:g}"
            if case.pool == "mamba" and o.hybrid_reserve == "whole":
                env["KVCACHED_MIN_RESERVED_PAGES"] = env["KVCACHED_MAX_RESERVED_PAGES"] = str(WHOLE_POOL_PAGES)
        if deep_gemm:
            env.setdefault("SGLANG_ENABLE_JIT_DEEPGEMM", "false")
        tree = o.native_path if (o.native_path and not on) else None     # else the caller's SGLang
        fleet[label] = servers.local_server(o.python, args, port, logs / f"{label}.log", env, tree,
                                            [str(matrix.PLUGIN)], o.gpu, deep_gemm, cls=FleetServer, label=label,
                                            role=role, case=case, kvcached=on, ipc_name=ipc)
        if small:
            small_host = label
    return fleet, small_host


class Fleet:
    """The run's servers and the state every part of the run reads."""

    def __init__(self, members: dict[str, FleetServer], journal: Journal):
        self.servers, self.journal = members, journal
        self.stopping = threading.Event()     # the run is over (or was stopped)
        self.phase_stop = threading.Event()   # the current phase's clients stop
        self.shared_t0: float | None = None   # when the shared phase began
        self.boosted: str | None = None       # the shared server whose burst window it is
        self.on_death = lambda server: None   # told of each crash

    def shared(self) -> list[FleetServer]:
        return [s for s in self.servers.values() if s.role == "shared"]

    def up(self) -> list[str]:
        return [s.label for s in self.servers.values() if s.up.is_set()]

    def start_all(self, timeout: float) -> list[str]:
        """Launch every server, wait for all; the shared ones that did not come up."""
        for s in self.servers.values():
            s.launch(self.journal)
        ready = servers.side_by_side({s.label: (lambda s=s: s.wait_up(self.journal, timeout))
                                      for s in self.servers.values()})
        return [label for label, ok in ready.items() if not ok and self.servers[label].role == "shared"]

    def watch(self) -> None:
        """A server that exits without the harness killing it is a crash."""
        seen = set()
        while not self.stopping.wait(0.5):
            for s in list(self.servers.values()):
                p = s.process
                if p is None or p.poll() is None or s.expect_exit or (s.label, s.generation) in seen:
                    continue
                seen.add((s.label, s.generation))
                s.up.clear()
                self.on_death(s)
                self.journal.write({"type": "server", "event": "died", "server": s.label, "returncode": p.returncode,
                                    "generation": s.generation, **judge.scan_log(s.log_text())})
                print(f"[{self.journal.now():5.0f} s] server {s.label} died (exit {p.returncode})", flush=True)

    def stop_all(self) -> None:
        servers.stop_all(self.servers.values())


def environment(opts) -> dict:
    """What the servers ran on: Python, GPUs, the versions they import (the caller's SGLang)."""
    return {**servers.machine(opts.python), "server_flags": opts.server_flags, "env": opts.env}
