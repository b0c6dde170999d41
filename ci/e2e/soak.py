#!/usr/bin/env python3
"""Soak: several models on one GPU, each with HiCache over kvcached, under load and faults.

    python3 ci/e2e/soak.py --out build/soak/run.json [--duration 600] [--models qwen2-tiny deepseek-v2-tiny]
        [--server-flags "..."] [--detach]
    python3 ci/e2e/soak.py --rebuild build/soak/run.events.jsonl --out R.json  (report again from a journal)
    python3 ci/e2e/soak.py --table R1.json R2.json ...                         (docs/soak-results.md rows)

Servers (SGLang 0.5.20's `python -m sglang.launch_server`, started side by side with the
interpreter and environment of the caller, `--enable-hierarchical-cache` on every one):
  shared s0, s1[, s2]  one per --models entry, kvcached on (ENABLE_KVCACHED=true, each its own
                       KVCACHED_IPC_NAME), all on one GPU under one KV budget (soak_kvc.Arbiter):
                       --budget-fraction of what their pools want, each kept at --floor-tokens at
                       least, the spare following the burst window from server to server;
  ref-native-<model>   kvcached off, unshared: the oracle's solo answers, then the reference load;
  ref-kvcached-<model> kvcached on, unshared (no limit set): the reference load.
Phases: start all; solo (each catalogue prompt answered alone by ref-native); reference load
(--ref-duration per model, native and unshared kvcached side by side, then ref-kvcached stops);
shared (--duration: clients on every shared server, bursts rotating, faults); after (a killed
server's restart awaited and its answers checked, `rejoin`). Faults in the shared phase:
small host pool (the last shared server runs --small-host-ratio), client disconnects, /flush_cache
under load then drained, kill -9 of one shared server and its restart. See soak_verdict for
the oracle, docs/soak-results.md for every field of the report.

Files, written as the run goes (a crash of the harness loses nothing): OUT (the report, rewritten
every --report-every s and at the end), OUT.events.jsonl (every request, counter sample, server
event and fault), OUT.status.json (phase, progress, done), OUT.log (with --detach), server logs in
OUT-logs/. Exit status: 0 pass, 1 fail or incomplete, 2 bad input.

On the H200 (after `source .e2e/setup.sh` and `python3 scripts/apply /tmp/site`):
    F="--attention-backend triton --sampling-backend pytorch --disable-cuda-graph --grammar-backend none \\
       --mem-fraction-static 0.3 --disable-custom-all-reduce --linear-attn-prefill-backend triton"
    python3 ci/e2e/soak.py --duration 60 --out $OUT/smoke.json --server-flags "$F" --env SGLANG_ENABLE_JIT_DEEPGEMM=false
    python3 ci/e2e/soak.py --out /tmp/soak/full.json --server-flags "$F" --env SGLANG_ENABLE_JIT_DEEPGEMM=false --detach
    cat /tmp/soak/full.status.json          (poll; "done": true at the end)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import compare_servers as e2e  # noqa: E402
import e2e_matrix as matrix  # noqa: E402
import e2e_verdict as judge  # noqa: E402
import soak_kvc as kvc  # noqa: E402
import soak_traffic as traffic  # noqa: E402
import soak_verdict as verdict  # noqa: E402
from real_kernels import sgl_kernel_calls  # noqa: E402

STANDIN_SITE = HERE / "standin" / "site"
DEFAULT_MODELS = ("qwen2-tiny", "deepseek-v2-tiny")
SOAK_CASES = ("qwen2-tiny", "deepseek-v2-tiny", "qwen3.5-tiny", "mellum-tiny")


class Interrupted(Exception):
    """SIGTERM or SIGINT reached the harness."""


class Journal:
    """Events, one JSON object a line, flushed at once; thread-safe."""

    def __init__(self, path: Path, started: float):
        self.path, self.started = path, started
        self.lock = threading.Lock()
        self.handle = open(path, "a")

    def now(self) -> float:
        return round(time.time() - self.started, 3)

    def write(self, event: dict) -> dict:
        event = {"t": self.now(), **event}
        with self.lock:
            self.handle.write(json.dumps(event) + "\n")
            self.handle.flush()
        return event


class Server:
    """One SGLang server process group: launched, watched, killed, restarted."""

    def __init__(self, label: str, role: str, case: matrix.Case, kvcached: bool, port: int, args: list[str],
                 env: dict[str, str], process_env: dict[str, str], command: list[str], log: Path,
                 ipc_name: str | None):
        self.label, self.role, self.case, self.kvcached = label, role, case, kvcached
        self.port, self.args, self.env, self.process_env = port, args, env, process_env
        self.command, self.log, self.ipc_name = command, log, ipc_name
        self.base = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None
        self.up = threading.Event()           # answering; clients wait while it is not
        self.paused = threading.Event()       # clients hold back (a drained flush)
        self.expect_exit = False              # a kill or stop by the harness
        self.generation = 0                   # starts so far
        self.inflight = 0
        self.lock = threading.Lock()

    def launch(self, journal: Journal) -> None:
        self.generation += 1
        with open(self.log, "a") as handle:
            handle.write(f"\n===== soak: start {self.generation} =====\n")
            handle.flush()
            self.process = subprocess.Popen(self.command, stdout=handle, stderr=subprocess.STDOUT,
                                            env=self.process_env, start_new_session=True)
        # only now: until the new process stands in self.process, the watcher must not take
        # the killed one's exit for a crash
        self.expect_exit = False
        journal.write({"type": "server", "event": "launched", "server": self.label, "role": self.role,
                       "model": self.case.name, "pool": self.case.pool, "kvcached": self.kvcached,
                       "ipc_name": self.ipc_name, "port": self.port, "command": self.command, "env": self.env,
                       "log": str(self.log), "generation": self.generation})

    def wait_ready(self, journal: Journal, timeout: float) -> bool:
        began = time.time()
        why = e2e.wait_ready(self.base, self.process, timeout)
        if why:
            journal.write({"type": "server", "event": "not ready", "server": self.label, "why": why,
                           **judge.scan_log(self.log.read_text(errors="replace"))})
            return False
        self.up.set()
        scan = judge.scan_log(self.log.read_text(errors="replace"))
        journal.write({"type": "server", "event": "ready", "server": self.label, "generation": self.generation,
                       "start_s": round(time.time() - began, 1), "weights_redrawn": scan["weights_redrawn"],
                       "kvcached_lines": len(scan["kvcached_lines"])})
        return True

    def kill9(self) -> None:
        self.expect_exit = True
        self.up.clear()
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)

    def stop(self) -> None:
        self.expect_exit = True
        self.up.clear()
        if self.process:
            e2e.stop(self.process)


def plan_faults(duration: float, shared: list[str]) -> list[dict]:
    """When each fault of the shared phase starts (seconds into it) and on which server.
    The kill takes the second shared server (the first stays up through everything), the
    drained flush and the disconnects the first."""
    first, second = shared[0], shared[1 % len(shared)]
    return [
        {"at": round(0.15 * duration, 1), "kind": "disconnects", "server": first},
        {"at": round(0.25 * duration, 1), "kind": "flush-under-load", "server": first},
        {"at": round(0.40 * duration, 1), "kind": "kill-9", "server": second},
    ]


def burst_owner(elapsed: float, period: float, live: list[str]) -> str | None:
    """The server whose burst window this is: live shared servers in turn, `period` s each."""
    if not live:
        return None
    return live[int(elapsed // period) % len(live)]


class Soak:
    def __init__(self, opts):
        self.opts = opts
        self.out = Path(opts.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.time()
        self.events_path = self.out.with_name(self.out.stem + ".events.jsonl")
        self.status_path = self.out.with_name(self.out.stem + ".status.json")
        self.logs = Path(opts.logs or self.out.with_name(self.out.stem + "-logs"))
        self.logs.mkdir(parents=True, exist_ok=True)
        self.events_path.write_text("")
        self.journal = Journal(self.events_path, self.started)
        self.phase = "start"
        self.stopping = threading.Event()
        self.phase_stop = threading.Event()
        self.counts = {"ok": 0, "mismatch": 0, "error": 0, "host": 0}
        self.count_lock = threading.Lock()
        self.reference: dict[tuple[str, str], list[int]] = {}
        self.cases = [matrix.CASES[m] for m in opts.models]
        self.catalogues = {c.name: traffic.build_catalogue(opts.seed + i, c.vocab_size, self.shape())
                           for i, c in enumerate(self.cases)}
        self.servers: dict[str, Server] = {}
        self.arbiter: kvc.Arbiter | None = None
        self.instances: dict[str, kvc.Instance] = {}
        self.boosted: str | None = None
        self.shared_t0: float | None = None
        self.faults_done: list[dict] = []
        self.small_host: str | None = None
        self.sample_lock = threading.Lock()
        self.config = self.make_config()

    def shape(self) -> traffic.Shape:
        return traffic.Shape() if not self.opts.small_catalogue else traffic.Shape(
            prefixes=2, conversations=4, turns=2, long_prompts=2, short_prompts=2, long_tokens=(600, 900))

    # ---- setup ----------------------------------------------------------------------

    def make_config(self) -> dict:
        o = self.opts
        return {"argv": sys.argv[1:], "models": o.models, "duration_s": o.duration, "ref_duration_s": o.ref_duration,
                "clients": o.clients, "burst_clients": o.burst_clients, "burst_period_s": o.burst_period,
                "max_total_tokens": o.max_total_tokens, "budget_fraction": o.budget_fraction,
                "floor_tokens": o.floor_tokens, "max_cached_tokens": o.max_cached_tokens,
                "hicache_ratio": o.hicache_ratio,
                "small_host_ratio": o.small_host_ratio, "max_new_tokens": o.max_new_tokens,
                "abort_rate": o.abort_rate, "deterministic": not o.no_deterministic, "seed": o.seed,
                "server_flags": o.server_flags, "env": o.env, "python": o.python,
                "catalogue_tokens": {n: c.distinct_tokens() for n, c in self.catalogues.items()},
                "catalogue_prompts": {n: len(c.prompts) for n, c in self.catalogues.items()},
                "patches": e2e.patches_state()["digest"]}

    def build_servers(self) -> None:
        o = self.opts
        specs = [(f"s{i}", "shared", case, True) for i, case in enumerate(self.cases)]
        if not o.no_reference:
            for case in dict.fromkeys(self.cases):
                specs.append((f"ref-native-{case.name}", "ref-native", case, False))
                specs.append((f"ref-kvcached-{case.name}", "ref-kvcached", case, True))
        base = o.port or e2e.free_port_block(len(specs))
        extra_flags = [f for chunk in o.server_flags for f in chunk.split()]
        if not o.no_deterministic:
            extra_flags.append("--enable-deterministic-inference")
        extra_env = e2e.parse_env(o.env)
        deep_gemm = self.needs_standin()
        tag = f"soak{os.getpid() % 100000}"
        for i, (label, role, case, on) in enumerate(specs):
            port = base + 10 * i
            small = role == "shared" and label == f"s{len(self.cases) - 1}" and o.small_host_ratio
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
            if deep_gemm:
                env.setdefault("SGLANG_ENABLE_JIT_DEEPGEMM", "false")
            path = [*([str(Path(o.native_path).resolve())] if (o.native_path and not on) else []),
                    str(matrix.PLUGIN), os.environ.get("PYTHONPATH", ""),
                    *([str(STANDIN_SITE)] if deep_gemm else [])]
            process_env = {**os.environ, **env, "PYTHONPATH": ":".join(p for p in path if p)}
            if o.gpu is not None:
                process_env["CUDA_VISIBLE_DEVICES"] = o.gpu
            command = e2e.launch_command("local", o.python, None, env, args, [])
            self.servers[label] = Server(label, role, case, on, port, args, env, process_env, command,
                                         self.logs / f"{label}.log", ipc)
            if small:
                self.small_host = label

    def needs_standin(self) -> bool:
        """deep_gemm (which SGLang's DeepSeek model file imports) missing from the servers'
        environment: put the import-only stand-in on their path (ci/e2e/standin)."""
        if not any(c.pool == "mla" for c in self.cases):
            return False
        probe = subprocess.run([self.opts.python, "-c", "import importlib.util as u; print(u.find_spec('deep_gemm') is None)"],
                               capture_output=True, text=True, env={**os.environ, "ENABLE_KVCACHED": "false"})
        return probe.stdout.strip() == "True"

    # ---- status and report ------------------------------------------------------------

    def status(self, done: bool = False, result: str | None = None) -> None:
        with self.count_lock:
            counts = dict(self.counts)
        state = {"pid": os.getpid(), "phase": self.phase, "elapsed_s": round(time.time() - self.started),
                 "shared_elapsed_s": round(time.time() - self.shared_t0) if self.shared_t0 else None,
                 "phase_answers": counts, "servers_up": [s.label for s in self.servers.values() if s.up.is_set()],
                 "boosted": self.boosted, "faults_done": [f["kind"] for f in self.faults_done],
                 "done": done, "result": result, "report": str(self.out), "events": str(self.events_path)}
        tmp = self.status_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.status_path)

    def write_report(self) -> dict:
        report = verdict.summarize(verdict.read_journal(self.events_path), self.config)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(self.out)
        return report

    def progress(self) -> None:
        last_report = time.time()
        while not self.stopping.wait(self.opts.progress_every):
            with self.count_lock:
                c = dict(self.counts)
            limits = ""
            if self.arbiter:
                limits = " limits MiB " + ", ".join(
                    f"{i.server}={(kvc.read_instance(self.opts.shm_dir, i) or {}).get('limit', 0) >> 20}"
                    for i in self.instances.values())
            shared = f" {time.time() - self.shared_t0:.0f}/{self.opts.duration:.0f} s" if self.shared_t0 else ""
            print(f"[{time.time() - self.started:5.0f} s] {self.phase}{shared}: answers {c['ok']} "
                  f"(host-hit tokens {c['host']}), differing {c['mismatch']}, errors {c['error']}, "
                  f"burst {self.boosted}{limits}", flush=True)
            self.status()
            if time.time() - last_report >= self.opts.report_every:
                self.write_report()
                last_report = time.time()

    # ---- requests ---------------------------------------------------------------------

    def request(self, server: Server, role: str, key: str, abort_after: float | None = None) -> dict:
        cat = self.catalogues[server.case.name]
        gen = server.generation
        with server.lock:
            server.inflight += 1
        try:
            rec = traffic.stream_generate(server.base, cat.prompts[key].ids, self.opts.max_new_tokens,
                                          self.opts.request_timeout, abort_after)
        finally:
            with server.lock:
                server.inflight -= 1
        rec = {"type": "request", "role": role, "server": server.label, "model": server.case.name, "key": key,
               "generation": gen, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}}
        if rec["outcome"] == "error" and (server.expect_exit or gen != server.generation or not server.up.is_set()):
            rec["expected_error"] = True      # lost to a kill of its server
        ref = self.reference.get((server.case.name, key))
        if rec["outcome"] == "ok" and ref is not None:
            rec["match"] = rec["output_ids"] == ref
        if role != "solo":
            with self.count_lock:
                if rec["outcome"] == "ok":
                    self.counts["ok"] += 1
                    self.counts["host"] += rec.get("host", 0)
                    self.counts["mismatch"] += rec.get("match") is False
                elif rec["outcome"] == "error" and not rec.get("expected_error"):
                    self.counts["error"] += 1
        self.journal.write(rec)
        return rec

    def client(self, server: Server, role: str, index: int, burst: bool, window: tuple[int, int],
               t0: float) -> None:
        """One client: sessions until the phase stops; a burst client only in its server's
        burst window (window: this server's index and the number of windows)."""
        rng = random.Random(f"{self.opts.seed}/{server.case.name}/{index}")
        cat = self.catalogues[server.case.name]
        mine, count = window
        while not self.phase_stop.is_set():
            if burst and role != "shared":
                if int((time.time() - t0) // self.opts.burst_period) % count != mine:
                    self.phase_stop.wait(0.2)
                    continue
            if burst and role == "shared" and self.boosted != server.label:
                self.phase_stop.wait(0.2)
                continue
            if not server.up.is_set() or server.paused.is_set():
                self.phase_stop.wait(0.2)
                continue
            for key in traffic.session(cat, rng):
                if self.phase_stop.is_set() or not server.up.is_set() or server.paused.is_set():
                    break
                abort = rng.uniform(0.02, 0.3) if rng.random() < self.opts.abort_rate else None
                self.request(server, role, key, abort)
                time.sleep(rng.uniform(0, 0.05))

    def run_clients(self, plan: list[tuple[Server, str, tuple[int, int]]], seconds: float,
                    extra=None) -> None:
        self.phase_stop.clear()
        t0 = time.time()
        threads = []
        for server, role, window in plan:
            for i in range(self.opts.clients + self.opts.burst_clients):
                threads.append(threading.Thread(target=self.client, daemon=True,
                                                args=(server, role, i, i >= self.opts.clients, window, t0)))
        for t in threads:
            t.start()
        if extra:
            extra(t0)
        self.phase_stop.wait(max(0.0, seconds - (time.time() - t0)))
        self.phase_stop.set()
        for t in threads:
            t.join(timeout=self.opts.request_timeout + 5)

    # ---- phases -----------------------------------------------------------------------

    def begin(self, phase: str) -> None:
        self.phase = phase
        with self.count_lock:
            self.counts = dict.fromkeys(self.counts, 0)
        self.journal.write({"type": "phase", "phase": phase, "event": "begin"})
        print(f"[{time.time() - self.started:5.0f} s] phase {phase}", flush=True)
        self.status()

    def end(self, phase: str) -> None:
        self.journal.write({"type": "phase", "phase": phase, "event": "end"})

    def start_servers(self) -> bool:
        self.begin("start")
        for s in self.servers.values():
            s.launch(self.journal)
        ready = {}
        threads = [threading.Thread(target=lambda s=s: ready.__setitem__(s.label, s.wait_ready(
            self.journal, self.opts.ready_timeout))) for s in self.servers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.end("start")
        missing = [label for label, ok in ready.items() if not ok and self.servers[label].role == "shared"]
        if missing:
            print(f"shared server(s) not ready: {', '.join(missing)}; see {self.logs}", flush=True)
            return False
        return True

    def solo(self) -> None:
        """Each catalogue prompt answered alone by its model's native server."""
        self.begin("solo")

        def one(server: Server):
            for key in self.catalogues[server.case.name].prompts:
                if self.stopping.is_set():
                    return
                rec = self.request(server, "solo", key)
                if rec["outcome"] == "ok":
                    self.reference.setdefault((server.case.name, key), rec["output_ids"])
        threads = [threading.Thread(target=one, args=(s,)) for s in self.servers.values()
                   if s.role == "ref-native" and s.up.is_set()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.end("solo")

    def reference_load(self) -> None:
        n = len(self.cases)
        for i, case in enumerate(dict.fromkeys(self.cases)):
            pair = [s for s in self.servers.values() if s.case is case and s.role in ("ref-native", "ref-kvcached")
                    and s.up.is_set()]
            if not pair or self.stopping.is_set():
                continue
            self.begin(f"reference-{case.name}")
            self.run_clients([(s, s.role, (i, n)) for s in pair], self.opts.ref_duration)
            self.sample()
            self.end(f"reference-{case.name}")
        for s in self.servers.values():
            if s.role == "ref-kvcached":
                s.stop()

    def sample(self) -> None:
        """kvcached's counters of every instance; the arbiter's limits applied first."""
        with self.sample_lock:
            self._sample()

    def _sample(self) -> None:
        if self.arbiter:
            live = [s.label for s in self.servers.values() if s.role == "shared" and s.up.is_set()]
            if self.shared_t0 is not None:
                self.boosted = burst_owner(time.time() - self.shared_t0, self.opts.burst_period, live)
            boosted_inst = self.servers[self.boosted].ipc_name if self.boosted else None
            self.arbiter.apply(boosted_inst)
        counters = {}
        for s in self.servers.values():
            if not s.kvcached or s.ipc_name not in self.instances:
                continue
            inst = self.instances[s.ipc_name]
            c = kvc.read_instance(self.opts.shm_dir, inst)
            if c is not None:
                counters[s.label] = {**c, "live": inst.live and s.up.is_set(), "role": s.role}
        self.journal.write({"type": "sample", "instances": counters, "boosted": self.boosted})

    def sampler(self) -> None:
        while not self.stopping.wait(self.opts.sample_every):
            try:
                self.sample()
            except OSError as exc:
                self.journal.write({"type": "note", "what": f"sampling failed: {exc}"})

    def shared(self) -> None:
        o = self.opts
        self.begin("shared")
        shared = [s for s in self.servers.values() if s.role == "shared"]
        for s in shared:   # wants known from the first read of each instance's segments
            kvc.read_instance(o.shm_dir, self.instances[s.ipc_name])
        want = sum(self.instances[s.ipc_name].want() for s in shared)
        budget = int(o.budget_fraction * want)
        self.arbiter = kvc.Arbiter(o.shm_dir, [self.instances[s.ipc_name] for s in shared], budget, o.floor_tokens)
        floors = {i.server: self.arbiter.floor(i) for i in self.arbiter.instances}
        self.config.update({"budget_bytes": budget, "wants_bytes": {i.server: i.want() for i in self.arbiter.instances},
                            "floors_bytes": floors, "reclaim_min_bytes": 2 << 20})
        if budget <= sum(floors.values()) or not want:
            self.journal.write({"type": "note", "what": f"budget {budget} B leaves no spare over the floors {floors}"})
        self.journal.write({"type": "budget", **{k: self.config[k] for k in ("budget_bytes", "wants_bytes", "floors_bytes",
                                                                          "reclaim_min_bytes")}})
        self.shared_t0 = time.time()
        self.sample()
        if self.small_host:
            self.small_host_fault()
        faults = plan_faults(o.duration, [s.label for s in shared])
        fault_threads = [threading.Thread(target=self.run_fault, args=(f,), daemon=True) for f in faults]
        self.run_clients([(s, "shared", (i, len(shared))) for i, s in enumerate(shared)], o.duration,
                         extra=lambda t0: [t.start() for t in fault_threads])
        self.end("shared")
        for t in fault_threads:
            t.join(timeout=o.restart_timeout + 60)
        if any(t.is_alive() for t in fault_threads):
            self.journal.write({"type": "note", "what": "faults still running after the shared phase"})

    def small_host_fault(self) -> None:
        s = self.servers[self.small_host]
        host_tokens = int(self.opts.small_host_ratio * self.opts.max_total_tokens)
        need = self.config["catalogue_tokens"][s.case.name]
        self.faults_done.append(self.journal.write({
            "type": "fault", "kind": "small-host-pool", "server": s.label, "at": 0,
            "detail": {"hicache_ratio": self.opts.small_host_ratio, "host_tokens": host_tokens,
                       "catalogue_tokens": need},
            "ok": host_tokens < need, "why": "" if host_tokens < need else
            f"host pool ({host_tokens} tokens) holds the whole catalogue ({need}): not too small"}))

    # ---- faults -----------------------------------------------------------------------

    def run_fault(self, f: dict) -> None:
        """One fault at its time (its own thread), recorded with what followed it."""
        delay = self.shared_t0 + f["at"] - time.time()
        if self.phase_stop.wait(max(0.0, delay)) or self.stopping.is_set():
            self.journal.write({"type": "fault", "kind": f["kind"], "server": f["server"], "at": f["at"],
                                "ok": None, "why": "not reached: the phase ended first"})
            return
        server = self.servers[f["server"]]
        self.journal.write({"type": "fault-begin", "kind": f["kind"], "server": server.label})
        try:
            rec = getattr(self, "fault_" + f["kind"].replace("-", "_").replace("9", "nine"))(server)
        except Exception as exc:   # the run goes on; the fault says what broke
            rec = {"ok": False, "why": f"{type(exc).__name__}: {exc}"}
        self.faults_done.append(self.journal.write({"type": "fault", "kind": f["kind"], "server": server.label,
                                                    "at": f["at"], **rec}))

    def observe(self) -> float:
        """Seconds to watch what follows a fault: a tenth of the phase, 3 to 10."""
        return min(10.0, max(3.0, self.opts.duration / 10))

    def answers_since(self, server: str, t: float) -> dict:
        """Answers of a server since journal time t, from the journal."""
        out = {"ok": 0, "differ": 0, "errors": 0, "host_tokens": 0}
        for e in verdict.read_journal(self.events_path):
            if e.get("type") == "request" and e["server"] == server and e["t"] >= t and e["role"] != "solo":
                if e["outcome"] == "ok":
                    out["ok"] += 1
                    out["differ"] += e.get("match") is False
                    out["host_tokens"] += e.get("host", 0)
                elif e["outcome"] == "error" and not e.get("expected_error"):
                    out["errors"] += 1
        return out

    def fault_disconnects(self, server: Server) -> dict:
        t = self.journal.now()
        rng = random.Random(self.opts.seed)
        keys = list(self.catalogues[server.case.name].prompts)
        recs = []
        threads = [threading.Thread(target=lambda k=k, a=a: recs.append(self.request(server, "shared", k, a)))
                   for k, a in ((rng.choice(keys), rng.uniform(0.01, 0.2)) for _ in range(8))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        self.phase_stop.wait(self.observe())
        after = self.answers_since(server.label, t)
        alive = server.process.poll() is None
        return {"detail": {"sent": 8, "aborted": sum(r["outcome"] == "aborted" for r in recs)},
                "followed": {"server_alive": alive, **after},
                "ok": alive and after["ok"] > 0 and not after["errors"],
                "why": "" if alive and after["ok"] else "the server stopped answering after clients hung up"}

    def fault_flush_under_load(self, server: Server) -> dict:
        t = self.journal.now()
        before = self.answers_since(server.label, max(0, t - self.observe()))
        under = self.flush(server)
        server.paused.set()
        deadline = time.time() + 30
        while server.inflight and time.time() < deadline:
            time.sleep(0.05)
        # SGLang flushes only when idle: with a timeout it waits for that (a request a client
        # hung up on may still be running) instead of refusing at once
        drained = self.flush(server, wait_s=10)
        server.paused.clear()
        t_after = self.journal.now()
        self.phase_stop.wait(self.observe())
        after = self.answers_since(server.label, t_after)
        ok = drained.get("status") == 200 and after["ok"] > 0 and not after["errors"]
        return {"detail": {"under_load": under, "drained": drained, "observed_s": self.observe()},
                "followed": {"before": before, "after": after},
                "ok": ok, "why": "" if ok else "flush after draining did not succeed, or the server did not answer after it"}

    def flush(self, server: Server, wait_s: float = 0) -> dict:
        t = time.time()
        try:
            body = e2e.post(f"{server.base}/flush_cache" + (f"?timeout={wait_s:g}" if wait_s else ""), {},
                            timeout=60 + wait_s)
            return {"status": 200, "body": str(body)[:200], "s": round(time.time() - t, 3)}
        except urllib.error.HTTPError as exc:
            return {"status": exc.code, "body": exc.read().decode(errors="replace")[:200]}
        except (urllib.error.URLError, OSError) as exc:
            return {"status": None, "body": f"{type(exc).__name__}: {exc}"}

    def fault_kill_nine(self, server: Server) -> dict:
        inst = self.instances[server.ipc_name]
        others = [i for i in self.arbiter.instances if i is not inst]
        before = {i.server: kvc.read_instance(self.opts.shm_dir, i) for i in self.arbiter.instances}
        t_kill = self.journal.now()
        server.kill9()
        inst.live = False
        removed = kvc.remove_segments(self.opts.shm_dir, inst.name)
        inst.wants.clear()
        self.journal.write({"type": "server", "event": "killed", "server": server.label, "segments_removed": removed})
        # the others' limits rise at once (the arbiter's next tick); watch their use grow
        peak = {i.server: 0 for i in others}
        peak_limit = {i.server: 0 for i in others}
        watch_until = time.time() + 2 * self.observe()
        while time.time() < watch_until and not self.stopping.is_set():
            for i in others:
                c = kvc.read_instance(self.opts.shm_dir, i) or {}
                peak[i.server] = max(peak[i.server], c.get("used", 0))
                peak_limit[i.server] = max(peak_limit[i.server], c.get("limit", 0))
            time.sleep(0.25)
        survivors = {i.server: self.answers_since(i.server, t_kill) for i in others}
        gained = {n: {"limit_before": (before.get(n) or {}).get("limit"), "limit_after": peak_limit[n],
                      "used_before": (before.get(n) or {}).get("used"), "used_peak_after": peak[n]}
                  for n in peak}
        server.launch(self.journal)
        began = time.time()
        ready = server.wait_ready(self.journal, self.opts.restart_timeout)
        restart_s = round(time.time() - began, 1)
        if ready:
            inst.live = True
        grew = any((g["limit_after"] or 0) > (g["limit_before"] or 0) for g in gained.values())
        ok = ready and grew and all(not v["errors"] for v in survivors.values())
        why = [] if ready else [f"not ready again within {self.opts.restart_timeout:.0f} s"]
        if not grew:
            why.append("no survivor's kvcached limit rose after the kill")
        why += [f"{n}: {v['errors']} failed requests after the kill" for n, v in survivors.items() if v["errors"]]
        return {"detail": {"before": before, "segments_removed": removed},
                "followed": {"survivors_counters": gained, "survivors_answers": survivors,
                             "restart_s": restart_s, "ready_again": ready},
                "ok": ok, "why": "; ".join(why)}

    def rejoin(self) -> None:
        """Answers of every restarted shared server, checked again after the run."""
        for s in self.servers.values():
            if s.role != "shared" or s.generation < 2 or not s.up.is_set():
                continue
            self.begin("rejoin")
            keys = list(self.catalogues[s.case.name].prompts)[: self.opts.rejoin_prompts]
            threads = [threading.Thread(target=lambda k=k: self.request(s, "rejoin", k)) for k in keys]
            for i in range(0, len(threads), 4):
                for th in threads[i:i + 4]:
                    th.start()
                for th in threads[i:i + 4]:
                    th.join()
            self.end("rejoin")

    # ---- watching ---------------------------------------------------------------------

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
                if s.kvcached and s.ipc_name in self.instances:
                    self.instances[s.ipc_name].live = False
                self.journal.write({"type": "server", "event": "died", "server": s.label, "returncode": p.returncode,
                                    "generation": s.generation, **judge.scan_log(s.log.read_text(errors="replace"))})
                print(f"[{time.time() - self.started:5.0f} s] server {s.label} died (exit {p.returncode})", flush=True)

    # ---- the run ----------------------------------------------------------------------

    def stop_all(self, *_):
        """SIGTERM/SIGINT: stop the phases; run() stops the servers and writes the report
        (a further signal meanwhile is ignored: raised there, it would cut that short)."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.phase_stop.set()
        raise Interrupted()

    def run(self) -> int:
        self.journal.write({"type": "start", "config": self.config, "pid": os.getpid()})
        self.build_servers()
        for s in self.servers.values():
            if s.kvcached:
                kvc.remove_segments(self.opts.shm_dir, s.ipc_name)
                self.instances[s.ipc_name] = kvc.Instance(s.ipc_name, s.label, self.opts.max_total_tokens)
        threading.Thread(target=self.environment, daemon=True).start()
        helpers = [threading.Thread(target=f, daemon=True) for f in (self.watch, self.progress, self.sampler)]
        for h in helpers:
            h.start()
        finished = False
        try:
            if self.start_servers():
                self.solo()
                self.reference_load()
                self.shared()
                self.rejoin()
                self.sample()
                finished = True
            else:
                self.journal.write({"type": "note", "what": "a shared server did not start: nothing ran"})
        except Interrupted:
            self.journal.write({"type": "note", "what": "stopped by a signal"})
        finally:
            self.phase = "stopping"
            self.stopping.set()
            self.phase_stop.set()
            stoppers = [threading.Thread(target=s.stop) for s in self.servers.values()]
            for t in stoppers:
                t.start()
            for t in stoppers:
                t.join()
            for s in self.servers.values():
                if s.kvcached:
                    kvc.remove_segments(self.opts.shm_dir, s.ipc_name)
        if os.environ.get("SGLK_REAL_LOG"):   # on sglang-kernel's real ops (ci/e2e/real_kernels/setup.sh)
            self.journal.write({"type": "sgl_kernel_ops", **sgl_kernel_calls.summary(
                os.environ["SGLK_REAL_LOG"], os.environ.get("SGLK_CALL_LOG"))})
        if finished:
            self.journal.write({"type": "finish"})
        report = self.write_report()
        self.status(done=True, result=report["result"])
        print(verdict.table({self.out.name: report}))
        print("\n".join(report["problems"]) or "no problem", flush=True)
        return 0 if report["result"] == "pass" else 1

    def environment(self) -> None:
        ns = SimpleNamespace(launcher="local", python=self.opts.python, patched_path=str(ROOT / "build" / "none"),
                             server_flags=self.opts.server_flags, env=self.opts.env)
        try:
            self.journal.write({"type": "environment", **e2e.environment(ns)})
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            self.journal.write({"type": "environment", "error": str(exc)})


def options(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default="build/soak/report.json")
    ap.add_argument("--table", nargs="+", metavar="REPORT", help="print docs/soak-results.md rows of reports, exit")
    ap.add_argument("--rebuild", metavar="EVENTS", help="write --out again from a run's events journal, exit")
    ap.add_argument("--detach", action="store_true", help="run in the background (new session), log to OUT.log")
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=SOAK_CASES,
                    help="one shared server each (2 or 3)")
    ap.add_argument("--duration", type=float, default=600, help="seconds of the shared phase")
    ap.add_argument("--ref-duration", type=float, help="seconds of reference load per model (default: duration/10, 10..60)")
    ap.add_argument("--no-reference", action="store_true", help="no unshared servers (no oracle: every answer unchecked)")
    ap.add_argument("--clients", type=int, default=2, help="clients per server, always on")
    ap.add_argument("--burst-clients", type=int, default=6, help="more clients per server during its burst window")
    ap.add_argument("--burst-period", type=float, help="seconds of each burst window (default: duration/8, 8..30)")
    ap.add_argument("--max-total-tokens", type=int, default=32768, help="each server's device pool")
    ap.add_argument("--budget-fraction", type=float, default=0.5,
                    help="kvcached budget of the shared servers: this fraction of what their pools want")
    ap.add_argument("--floor-tokens", type=int, default=6144, help="no shared server's limit goes below this")
    ap.add_argument("--max-cached-tokens", type=int, default=2048,
                    help="KVCACHED_MAX_CACHED_TOKENS of the kvcached servers: finished requests' tokens kept on the "
                         "device (the rest lives in the host pool); below --floor-tokens, so a lowered limit takes effect")
    ap.add_argument("--hicache-ratio", type=float, default=4)
    ap.add_argument("--small-host-ratio", type=float, default=1.0,
                    help="the last shared server's --hicache-ratio (host pool smaller than its working set); 0: off")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--abort-rate", type=float, default=0.02, help="share of requests whose client hangs up mid-way")
    ap.add_argument("--no-deterministic", action="store_true", help="leave out --enable-deterministic-inference")
    ap.add_argument("--small-catalogue", action="store_true", help="a few short prompts only (harness tests)")
    ap.add_argument("--rejoin-prompts", type=int, default=24)
    ap.add_argument("--server-flags", action="append", default=[], help="more launch_server flags for every server")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="more server environment")
    ap.add_argument("--python", default=sys.executable, help="the servers' interpreter (default: this one)")
    ap.add_argument("--native-path", help="a folder holding SGLang 0.5.20's sglang/ as released, first on the "
                                          "native servers' path (default: the caller's SGLang, kvcached off)")
    ap.add_argument("--gpu", help="CUDA_VISIBLE_DEVICES of the servers (default: the caller's)")
    ap.add_argument("--port", type=int, help="first port (default: a free block)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--restart-timeout", type=float, default=240)
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--sample-every", type=float, default=0.5)
    ap.add_argument("--progress-every", type=float, default=10)
    ap.add_argument("--report-every", type=float, default=30)
    ap.add_argument("--shm-dir", default=kvc.SHM_DIR, help=argparse.SUPPRESS)
    ap.add_argument("--logs", help="server logs folder (default: next to --out)")
    opts = ap.parse_args(argv)
    if opts.table or opts.rebuild:
        return opts
    if not 2 <= len(opts.models) <= 3:
        ap.error("--models takes two or three models (one shared server each)")
    if opts.duration <= 0 or not 0 < opts.budget_fraction < 1:
        ap.error("--duration must be positive and --budget-fraction between 0 and 1")
    if not 0 <= opts.max_cached_tokens < opts.floor_tokens:
        ap.error("--max-cached-tokens must be from 0 to below --floor-tokens: kvcached lowers a pool's limit only "
                 "once its pages in use fit under it, and a server keeps that many cached tokens in use")
    if min(opts.clients, opts.burst_clients) < 0 or opts.clients + opts.burst_clients < 1:
        ap.error("--clients and --burst-clients must be non-negative, one of them positive")
    if opts.ref_duration is None:
        opts.ref_duration = min(60.0, max(10.0, opts.duration / 10))
    if opts.burst_period is None:
        opts.burst_period = min(30.0, max(8.0, opts.duration / 8))
    try:
        e2e.parse_env(opts.env)
    except ValueError as exc:
        ap.error(str(exc))
    return opts


def detach(argv: list[str], out: Path) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_name(out.stem + ".log")
    args = [a for a in argv if a != "--detach"]
    with open(log, "w") as handle:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], stdout=handle,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    status = out.with_name(out.stem + ".status.json")
    print(f"soak running in the background: pid {proc.pid}\n  log {log}\n  status {status} (\"done\": true at the end)"
          f"\n  report {out}", flush=True)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = options(argv)
    if opts.table:
        try:
            reports = {Path(p).name: json.loads(Path(p).read_text()) for p in opts.table}
        except (OSError, json.JSONDecodeError) as exc:
            print(f"error: cannot read a report: {exc}", file=sys.stderr)
            return 2
        print(verdict.table(reports))
        return 0
    if opts.rebuild:
        if not Path(opts.rebuild).is_file():
            print(f"error: no journal at {opts.rebuild}", file=sys.stderr)
            return 2
        report = verdict.summarize(verdict.read_journal(opts.rebuild))
        Path(opts.out).write_text(json.dumps(report, indent=1))
        print(verdict.table({Path(opts.out).name: report}))
        return 0
    if opts.detach:
        return detach(argv, Path(opts.out))
    soak = Soak(opts)
    handlers = {sig: signal.signal(sig, soak.stop_all) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return soak.run()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
