"""Soak: several models on one GPU, each with HiCache over kvcached, under load and faults.

    python -m harness.soak --out build/soak/run.json [--duration 600] [--models qwen2-tiny deepseek-v2-tiny ...]
        [--budget-mode fixed|arbiter] [--server-flags "..."] [--detach]
    python -m harness.soak --dry-run                                           (servers, budget; starts nothing)
    python -m harness.soak --rebuild build/soak/run.events.jsonl --out R.json  (report again from a journal)
    python -m harness.soak --table R1.json R2.json ...                         (the results table rows)

Servers (fleet.py): one shared server per --models entry (by default MHA, MLA and the Mamba
hybrid), kvcached on, all on one GPU under one KV budget (kvc.py; by default what they map
after a warm-up and --budget-fraction of what their pools want beyond it, each limit fixed
once, a ballast holding the rest of the GPU, the others held while a killed server restarts;
--budget-mode arbiter: --budget-fraction of what they want, floors of --floor-tokens and
the spare following the burst window), and per model an unshared native server (the oracle) and an unshared kvcached one.
Phases (run.py): start all; solo (each catalogue prompt answered alone by the native
reference); reference load (--ref-duration per model, native and unshared kvcached side by
side, then the unshared kvcached one stops); warmup (fixed mode: --warmup-s of every client
on every shared server); shared (the budget set, then --duration: clients on every shared
server, bursts rotating, faults: faults.py); after (a killed server's restart awaited and
its answers checked, `rejoin`).
Traffic: traffic.py; the oracle and the report: verdict.py; the report: docs/harness.md.

Files, written as the run goes (a crash of the harness loses nothing): OUT (the report, rewritten
every --report-every s and at the end), OUT.events.jsonl (every request, counter sample, server
event and fault), OUT.status.json (phase, progress, done), OUT.log (with --detach), server and
ballast logs in OUT-logs/. Exit status: 0 pass, 1 fail or incomplete, 2 bad input.

On a GPU: harness/soak/__init__.py gives the 10-minute three-model run on one H100.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from harness import project, servers
from harness.compare import matrix
from harness.rig.real_kernels import sgl_kernel_calls
from harness.sharing import ballast
from harness.soak import faults, kvc, traffic, verdict
from harness.soak import fleet as fleets

DEFAULT_MODELS = ("qwen2-tiny", "deepseek-v2-tiny", "qwen3.5-tiny")     # MHA, MLA, the Mamba hybrid
SOAK_CASES = ("qwen2-tiny", "deepseek-v2-tiny", "qwen3.5-tiny", "mellum-tiny")


class Interrupted(Exception):
    """SIGTERM or SIGINT reached the harness."""


class Soak:
    """One run: the fleet, its load, its budget and its faults, phase by phase."""

    def __init__(self, opts):
        self.opts = opts
        self.out = Path(opts.out)    # its folder made by options()
        self.started = time.time()
        self.events_path = self.out.with_name(self.out.stem + ".events.jsonl")
        self.status_path = self.out.with_name(self.out.stem + ".status.json")
        self.logs = Path(opts.logs or self.out.with_name(self.out.stem + "-logs"))
        self.logs.mkdir(parents=True, exist_ok=True)
        self.events_path.write_text("")
        self.phase = "start"
        self.cases = [matrix.CASES[m] for m in opts.models]
        catalogues = {c.name: traffic.build_catalogue(opts.seed + i, c.vocab_size, self.shape())
                      for i, c in enumerate(self.cases)}
        self.fleet = fleets.Fleet({}, fleets.Journal(self.events_path, self.started))
        self.load = traffic.Load(self.fleet, catalogues, opts)
        self.budget: kvc.Budget | None = None
        self.ballast = ballast.Holder()
        self.faults: faults.Faults | None = None
        self.small_host: str | None = None
        self.config = self.make_config()

    def shape(self) -> traffic.Shape:
        return traffic.Shape() if not self.opts.small_catalogue else traffic.Shape(
            prefixes=2, conversations=4, turns=2, long_prompts=2, short_prompts=2, long_tokens=(600, 900))

    def make_config(self) -> dict:
        o, cats = self.opts, self.load.catalogues
        return {"argv": sys.argv[1:], "models": o.models, "duration_s": o.duration, "ref_duration_s": o.ref_duration,
                "clients": o.clients, "burst_clients": o.burst_clients, "burst_period_s": o.burst_period,
                "max_total_tokens": o.max_total_tokens, "budget_mode": o.budget_mode,
                "budget_fraction": o.budget_fraction, "floor_tokens": o.floor_tokens,
                "max_cached_tokens": o.max_cached_tokens, "gpu_utilization": o.gpu_utilization,
                "warmup_s": o.warmup_s, "hybrid_reserve": o.hybrid_reserve,
                "hicache_ratio": o.hicache_ratio,
                "small_host_ratio": o.small_host_ratio, "max_new_tokens": o.max_new_tokens,
                "abort_rate": o.abort_rate, "deterministic": not o.no_deterministic, "seed": o.seed,
                "server_flags": o.server_flags, "env": o.env, "python": o.python,
                "catalogue_tokens": {n: c.distinct_tokens() for n, c in cats.items()},
                "catalogue_prompts": {n: len(c.prompts) for n, c in cats.items()},
                "patches": project.patches_state()["digest"]}

    @property
    def journal(self) -> fleets.Journal:
        return self.fleet.journal

    # ---- status and report ------------------------------------------------------------

    def status(self, done: bool = False, result: str | None = None) -> None:
        t0 = self.fleet.shared_t0
        state = {"pid": os.getpid(), "phase": self.phase, "elapsed_s": round(time.time() - self.started),
                 "shared_elapsed_s": round(time.time() - t0) if t0 else None,
                 "phase_answers": self.load.snapshot(), "servers_up": self.fleet.up(),
                 "boosted": self.fleet.boosted,
                 "faults_done": [f["kind"] for f in (self.faults.done if self.faults else [])],
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
        while not self.fleet.stopping.wait(self.opts.progress_every):
            c = self.load.snapshot()
            limits = f" {self.budget.limits_mib()}" if self.budget and self.budget.shared else ""
            t0 = self.fleet.shared_t0
            shared = f" {time.time() - t0:.0f}/{self.opts.duration:.0f} s" if t0 else ""
            print(f"[{time.time() - self.started:5.0f} s] {self.phase}{shared}: answers {c['ok']} "
                  f"(host-hit tokens {c['host']}), differing {c['mismatch']}, errors {c['error']}, "
                  f"burst {self.fleet.boosted}{limits}", flush=True)
            self.status()
            if time.time() - last_report >= self.opts.report_every:
                self.write_report()
                last_report = time.time()

    # ---- phases -----------------------------------------------------------------------

    def begin(self, phase: str) -> None:
        self.phase = phase
        self.load.reset_counts()
        self.journal.write({"type": "phase", "phase": phase, "event": "begin"})
        print(f"[{time.time() - self.started:5.0f} s] phase {phase}", flush=True)
        self.status()

    def end(self, phase: str) -> None:
        self.journal.write({"type": "phase", "phase": phase, "event": "end"})

    def start_servers(self) -> bool:
        self.begin("start")
        missing = self.fleet.start_all(self.opts.ready_timeout)
        self.end("start")
        if missing:
            print(f"shared server(s) not ready: {', '.join(missing)}; see {self.logs}", flush=True)
            return False
        return True

    def solo(self) -> None:
        """Each catalogue prompt answered alone by its model's native server."""
        self.begin("solo")
        threads = [threading.Thread(target=self.load.solo, args=(s,)) for s in self.fleet.servers.values()
                   if s.role == "ref-native" and s.up.is_set()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.end("solo")

    def reference_load(self) -> None:
        for case in dict.fromkeys(self.cases):
            pair = [s for s in self.fleet.servers.values()
                    if s.case is case and s.role in ("ref-native", "ref-kvcached") and s.up.is_set()]
            if not pair or self.fleet.stopping.is_set():
                continue
            self.begin(f"reference-{case.name}")
            # bursts in every other window from the phase's start (on, then quiet): each model's own bursts
            self.load.run_clients([(s, s.role, (0, 2)) for s in pair], self.opts.ref_duration)
            self.budget.sample()
            self.end(f"reference-{case.name}")
        for s in self.fleet.servers.values():
            if s.role == "ref-kvcached":
                s.stop()

    def warm_up(self, shared: list) -> None:
        """Fixed mode: every client on every shared server at once for --warmup-s (answers
        checked as any), so that each server's allocator has grown to what the load needs
        before the ballast is sized: what it took later would come out of the budget, since
        kvcached maps only while the GPU's free memory stays above its headroom. (Not
        /flush_cache after it: SGLang's flush empties torch's cache too.)"""
        if self.opts.warmup_s > 0:
            self.begin("warmup")
            self.load.run_clients([(s, "warmup", (0, 1)) for s in shared], self.opts.warmup_s)
            self.end("warmup")

    def hold_gpu(self, shared: list) -> dict:
        """Fixed mode: the shared servers idle for --settle-s (kvcached's cap trims their
        cached tokens, freed pages are unmapped), their limits fixed, then the ballast sized
        from what they map now (kvcached's counters), so that together they can map the
        budget and no more."""
        o = self.opts
        self.fleet.stopping.wait(o.settle_s)
        mapped = kvc.mapped_bytes(o.shm_dir, [s.ipc_name for s in shared])
        self.config.update(self.budget.share(shared, o.budget_fraction, o.floor_tokens, mapped))
        return self.ballast.start(o.python, self.config["budget_bytes"], mapped, o.gpu_utilization, o.gpu,
                                  self.logs / "ballast.log", o.ready_timeout)

    def shared(self) -> None:
        o = self.opts
        shared = self.fleet.shared()
        if o.budget_mode == "fixed":
            self.warm_up(shared)
        self.begin("shared")
        if o.budget_mode == "fixed":
            self.config["ballast"] = self.hold_gpu(shared)
        else:
            self.config.update(self.budget.share(shared, o.budget_fraction, o.floor_tokens))
        self.config["reclaim_min_bytes"] = 2 << 20
        budget, floors = self.config["budget_bytes"], self.config["floors_bytes"]
        if budget <= sum(floors.values()) or not sum(self.config["wants_bytes"].values()):
            self.journal.write({"type": "note", "what": f"budget {budget} B leaves no spare over the floors {floors}"})
        keys = ("budget_mode", "budget_bytes", "wants_bytes", "floors_bytes", "mapped_at_start_bytes", "limits_bytes",
                "ballast", "reclaim_min_bytes")
        self.journal.write({"type": "budget", **{k: self.config[k] for k in keys if k in self.config}})
        if "error" in self.config.get("ballast", {}):
            print(f"the ballast holds nothing: {self.config['ballast']['error']}", flush=True)
            self.end("shared")
            return
        self.fleet.shared_t0 = time.time()
        self.budget.sample()
        if self.small_host:
            s = self.fleet.servers[self.small_host]
            self.faults.small_host_pool(s, int(o.small_host_ratio * o.max_total_tokens),
                                        self.config["catalogue_tokens"][s.case.name])
        planned = faults.plan_faults(o.duration, [s.label for s in shared])
        fault_threads = [threading.Thread(target=self.faults.run, args=(f,), daemon=True) for f in planned]
        self.load.run_clients([(s, "shared", (i, len(shared))) for i, s in enumerate(shared)], o.duration,
                              extra=lambda t0: [t.start() for t in fault_threads])
        self.end("shared")
        for t in fault_threads:
            t.join(timeout=o.restart_timeout + 60)
        if any(t.is_alive() for t in fault_threads):
            self.journal.write({"type": "note", "what": "faults still running after the shared phase"})

    def rejoin(self) -> None:
        """Answers of every restarted shared server, checked again after the run."""
        for s in self.fleet.shared():
            if s.generation < 2 or not s.up.is_set():
                continue
            self.begin("rejoin")
            keys = list(self.load.catalogues[s.case.name].prompts)[: self.opts.rejoin_prompts]
            threads = [threading.Thread(target=lambda k=k: self.load.request(s, "rejoin", k)) for k in keys]
            for i in range(0, len(threads), 4):
                for th in threads[i:i + 4]:
                    th.start()
                for th in threads[i:i + 4]:
                    th.join()
            self.end("rejoin")

    # ---- the run ----------------------------------------------------------------------

    def stop_all(self, *_):
        """SIGTERM/SIGINT: stop the phases; run() stops the servers and writes the report
        (a further signal meanwhile is ignored: raised there, it would cut that short)."""
        if self.fleet.stopping.is_set():
            return
        self.fleet.stopping.set()
        self.fleet.phase_stop.set()
        raise Interrupted()

    def run(self) -> int:
        o = self.opts
        self.journal.write({"type": "start", "config": self.config, "pid": os.getpid()})
        self.fleet.servers, self.small_host = fleets.build(o, self.cases, self.logs)
        self.budget = kvc.Budget(self.fleet, o.shm_dir, o.max_total_tokens, o.burst_period, o.budget_mode)
        self.fleet.on_death = self.budget.lost
        self.faults = faults.Faults(self.fleet, self.load, self.budget, o)
        threading.Thread(target=self.environment, daemon=True).start()
        helpers = [threading.Thread(target=self.fleet.watch, daemon=True),
                   threading.Thread(target=self.progress, daemon=True),
                   threading.Thread(target=self.budget.sampler, args=(o.sample_every,), daemon=True)]
        for h in helpers:
            h.start()
        finished = False
        try:
            if self.start_servers():
                self.solo()
                self.reference_load()
                self.shared()
                self.rejoin()
                self.budget.sample()
                finished = True
            else:
                self.journal.write({"type": "note", "what": "a shared server did not start: nothing ran"})
        except Interrupted:
            self.journal.write({"type": "note", "what": "stopped by a signal"})
        except Exception:   # the report and "done" still written: whoever polls the status stops waiting
            self.journal.write({"type": "note", "what": "the harness failed: " + traceback.format_exc(limit=8)})
            traceback.print_exc()
        finally:
            self.phase = "stopping"
            self.fleet.stopping.set()
            self.fleet.phase_stop.set()
            self.fleet.stop_all()
            if died := self.ballast.stop():
                self.journal.write({"type": "ballast", "event": "exited", "what": died})
            self.budget.clear()
        if os.environ.get("SGLK_REAL_LOG"):   # on sglang-kernel's real ops (harness/rig/real_kernels/setup.sh)
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
        try:
            self.journal.write({"type": "environment", **fleets.environment(self.opts)})
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            self.journal.write({"type": "environment", "error": str(exc)})


def options(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default="build/soak/report.json")
    ap.add_argument("--table", nargs="+", metavar="REPORT", help="print the table rows of reports, exit")
    ap.add_argument("--rebuild", metavar="EVENTS", help="write --out again from a run's events journal, exit")
    ap.add_argument("--detach", action="store_true", help="run in the background (new session), log to OUT.log")
    ap.add_argument("--dry-run", action="store_true", help="print the servers (commands, environments) and the "
                                                           "budget's rules as JSON, start nothing")
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=SOAK_CASES,
                    help="one shared server each (2 or 3)")
    ap.add_argument("--duration", type=float, default=600, help="seconds of the shared phase")
    ap.add_argument("--ref-duration", type=float, help="seconds of reference load per model (default: duration/10, 10..60)")
    ap.add_argument("--no-reference", action="store_true", help="no unshared servers (no oracle: every answer unchecked)")
    ap.add_argument("--clients", type=int, default=2, help="clients per server, always on")
    ap.add_argument("--burst-clients", type=int, default=6, help="more clients per server during its burst window")
    ap.add_argument("--burst-period", type=float, help="seconds of each burst window (default: duration/8, 8..30)")
    ap.add_argument("--max-total-tokens", type=int, default=32768, help="each server's device pool")
    ap.add_argument("--budget-mode", choices=("fixed", "arbiter"), default="fixed",
                    help="fixed: each limit set once, the GPU held to the budget by a ballast (no controller); "
                         "arbiter: the spare follows the burst window (kvc.py)")
    ap.add_argument("--budget-fraction", type=float,
                    help="kvcached budget of the shared servers: this fraction of what their pools want (fixed: "
                         "beyond what they map after the warm-up; default 0.2) (arbiter: default 0.5)")
    ap.add_argument("--floor-tokens", type=int,
                    help="fixed: a server's limit is the budget less the others' floors; arbiter: no limit goes "
                         "below it (default: --max-cached-tokens fixed, 6144 arbiter)")
    ap.add_argument("--max-cached-tokens", type=int, default=2048,
                    help="KVCACHED_MAX_CACHED_TOKENS of the kvcached servers: finished requests' tokens kept on the "
                         "device (the rest lives in the host pool): what an idle server keeps")
    ap.add_argument("--hybrid-reserve", choices=("whole", "kvcached"), default="whole",
                    help="whole: a Mamba hybrid's kvcached pools stay mapped whole (KVCACHED_MIN_RESERVED_PAGES and "
                         "KVCACHED_MAX_RESERVED_PAGES above their size): kvcached 0.1.6 cannot promise a Mamba slot "
                         "when the GPU is short, and SGLang asserts (docs/upstream.md); kvcached: its defaults")
    ap.add_argument("--gpu-utilization", type=float, default=0.95,
                    help="KVCACHED_GPU_UTILIZATION of the kvcached servers (and the ballast's sizing)")
    ap.add_argument("--warmup-s", type=float, default=30,
                    help="fixed: seconds of every client on every shared server before the ballast is sized")
    ap.add_argument("--settle-s", type=float, default=5.0,
                    help="fixed: seconds the shared servers stay idle before the ballast is sized")
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
    if opts.floor_tokens is None:
        opts.floor_tokens = 6144 if opts.budget_mode == "arbiter" else opts.max_cached_tokens
    if opts.budget_fraction is None:
        opts.budget_fraction = 0.5 if opts.budget_mode == "arbiter" else 0.2
    if opts.duration <= 0 or not 0 < opts.budget_fraction < 1 or not 0 < opts.gpu_utilization <= 1:
        ap.error("--duration must be positive, --budget-fraction between 0 and 1, --gpu-utilization in (0, 1]")
    if opts.max_cached_tokens < 0 or opts.floor_tokens < 0:
        ap.error("--max-cached-tokens and --floor-tokens must be non-negative")
    if opts.budget_mode == "arbiter" and opts.max_cached_tokens >= opts.floor_tokens:
        ap.error("--max-cached-tokens must be below --floor-tokens with the arbiter: kvcached lowers a pool's limit "
                 "only once its pages in use fit under it, and a server keeps that many cached tokens in use")
    if min(opts.clients, opts.burst_clients) < 0 or opts.clients + opts.burst_clients < 1:
        ap.error("--clients and --burst-clients must be non-negative, one of them positive")
    if opts.ref_duration is None:
        opts.ref_duration = min(60.0, max(10.0, opts.duration / 10))
    if opts.burst_period is None:
        opts.burst_period = min(30.0, max(8.0, opts.duration / 8))
    try:
        servers.parse_env(opts.env)
    except ValueError as exc:
        ap.error(str(exc))
    if why := project.make_out(opts.out):
        ap.error(why)
    return opts


def rebuild(events: str, out: str) -> int:
    """--rebuild: the report of a run's journal written to --out, never over the journal."""
    journal = verdict.read_journal(events) if Path(events).is_file() else None
    if journal is None:
        why = f"no journal at {events}"
    elif Path(events).resolve() == Path(out).resolve():
        why = f"--out {out} is the journal --rebuild reads: name another file"
    elif not any(e.get("type") == "start" for e in journal):
        why = f"{events}: not a soak events journal (no start event)"
    else:
        why = project.make_out(out)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    report = verdict.summarize(journal)
    Path(out).write_text(json.dumps(report, indent=1))
    print(verdict.table({Path(out).name: report}))
    return 0


def dry_run(opts) -> int:
    """--dry-run: the servers a run would start and the budget's rules, as JSON."""
    logs = Path(opts.logs or Path(opts.out).with_name(Path(opts.out).stem + "-logs"))
    members, small_host = fleets.build(opts, [matrix.CASES[m] for m in opts.models], logs)
    fixed = opts.budget_mode == "fixed"
    plan = {"budget_mode": opts.budget_mode,
            "budget": (f"what the shared servers map after the warm-up, and {opts.budget_fraction:g} of what their "
                       "pools want beyond it (kvcached's counters)" if fixed else
                       f"{opts.budget_fraction:g} of what the shared servers' pools want (kvcached's counters)"),
            "limits": "each set once: the budget less the other shared servers' floors (--floor-tokens "
                      f"{opts.floor_tokens} of their tokens), at most what its pool wants" if fixed else
                      f"floors of {opts.floor_tokens} tokens, the spare to the server of the burst window",
            "ballast": f"free - total x (1 - {opts.gpu_utilization:g}) - (budget - mapped), after {opts.warmup_s:g} s "
                       f"of every client and {opts.settle_s:g} s idle" if fixed else None,
            "small_host": small_host,
            "servers": [{"label": s.label, "role": s.role, "model": s.case.name, "pool": s.case.pool,
                         "kvcached": s.kvcached, "command": s.command, "env": s.env} for s in members.values()]}
    print(json.dumps(plan, indent=1))
    return 0


def detach(argv: list[str], out: Path) -> int:
    log = out.with_name(out.stem + ".log")
    args = [a for a in argv if a != "--detach"]
    with open(log, "w") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "harness.soak", *args], stdout=handle,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    status = out.with_name(out.stem + ".status.json")
    print(f"soak running in the background: pid {proc.pid}\n  log {log}\n  status {status} (\"done\": true at the end)"
          f"\n  report {out}", flush=True)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = options(argv)
    if opts.table:
        reports = {}
        for p in opts.table:
            try:
                reports[Path(p).name] = json.loads(Path(p).read_text())
                verdict.table_row(p, reports[Path(p).name])    # another tool's report fails here, by name
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                print(f"error: {p}: not a soak report it can read ({type(exc).__name__}: {exc})", file=sys.stderr)
                return 2
        print(verdict.table(reports))
        return 0
    if opts.rebuild:
        return rebuild(opts.rebuild, opts.out)
    if opts.dry_run:
        return dry_run(opts)
    if opts.detach:
        return detach(argv, Path(opts.out))
    soak = Soak(opts)
    return servers.with_signals(soak.stop_all, soak.run)

