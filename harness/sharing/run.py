"""The sharing run: its options, its fleet, its slots, its journal (harness/sharing/__init__.py
says what it measures and how the budgets are made equal).

    python -m harness.sharing --preset two-mha --pristine-path P --patched-path Q [--out build/sharing]
        [--plan PLAN.json] [--set FIELD=JSON ...] [--server-flags "..."] [--env K=V ...] [--detach]
    python -m harness.sharing --preset mix --dry-run          (commands, environments, budgets; nothing runs)
    python -m harness.sharing --rebuild OUT/journal.jsonl     (the report again from a journal, whole or cut short)
    python -m harness.sharing --render OUT/report.json        (its markdown)

A run: the servers of every variant (or, with fleet "variant", of one at a time) start and
are checked against the plan (each log's device and host pools); each variant gets warmed
up (even load for warmup_s, not measured); (b)'s servers answer the correctness sample
alone (the reference). Then round after round, every variant once, the order rotated
(bench_server.round_orders): a *slot* flushes every server's caches, starts the ballast for
a kvcached variant, runs the phases against the variant's servers and, for (d), the sample
(each model's prompts alone while its siblings take even load), stops the ballast, and
records what the servers' logs say of retractions.

Files under --out, written as the run goes: journal.jsonl (one line per request, phase,
slot, server and ballast: a run cut short keeps what it measured), report.json and
summary.md (made again from the journal after every slot), status.json (where the run
is), ttft.png (with matplotlib), models/ (the written configs), logs/ (servers', ballast's),
run.log (with --detach). Exit status: 0 the run completed with no problem, 1 a problem
(listed in the report: a mismatch, a budget not as planned, a slot not run, ...), 2 bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from harness import bench_server, project, servers
from harness.compare import matrix
from harness.compare import verdict as judge
from harness.sharing import plan as P
from harness.sharing import ballast, summary, traffic
from harness.soak import kvc
from harness.soak.fleet import Journal


class Interrupted(Exception):
    """SIGTERM or SIGINT reached the harness."""


class BadInput(Exception):
    """An option or plan the run cannot take: one `error:` line, exit 2."""


class Run:
    def __init__(self, opts, plan: P.Plan, trees: dict | None = None):
        self.opts, self.plan, self.trees = opts, plan, trees
        self.out = Path(opts.out)
        self.started = time.time()
        self.journal_path = self.out / "journal.jsonl"
        self.journal_path.write_text("")
        self.journal = Journal(self.journal_path, self.started)
        self.events: list[dict] = []
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.labels = plan.labels
        self.extra_flags = servers.split_flags(opts.server_flags)
        self.extra_env = servers.parse_env(opts.env)
        self.catalogues = {label: traffic.build_catalogue(plan, plan.model(label).vocab_size, f"{plan.seed}/{i}")
                           for i, label in enumerate(self.labels)}
        self.samples = {label: traffic.sample_sequence(plan, plan.model(label).vocab_size, f"{plan.seed}/{i}")
                        for i, label in enumerate(self.labels)}
        self.servers: dict[tuple[str, str], servers.Server] = {}
        self.ipc: dict[tuple[str, str], str] = {}
        self.up: set[str] = set()
        self.failed: dict[str, str] = {}
        self.reference_done = False
        self.ballast = ballast.Holder()
        self.stopping = False
        self.status: dict = {"pid": os.getpid(), "done": False}

    # ---- journal and files -------------------------------------------------------------

    def record(self, event: dict) -> dict:
        event = self.journal.write(event)
        self.events.append(event)
        return event

    def log(self, text: str) -> None:
        print(f"[{time.time() - self.started:6.0f} s] {text}", flush=True)

    def set_status(self, **fields) -> None:
        self.status.update(fields, elapsed_s=round(time.time() - self.started))
        tmp = self.out / "status.json.tmp"
        tmp.write_text(json.dumps(self.status))
        tmp.replace(self.out / "status.json")

    def save(self) -> dict:
        report = summary.summarize(self.events)
        write_report(report, self.out)
        return report

    # ---- the fleet ---------------------------------------------------------------------

    def plan_servers(self, base: int, write: bool = True) -> None:
        o, plan = self.opts, self.plan
        deepseek = [label for label in self.labels if plan.model(label).config["model_type"].startswith("deepseek")]
        standin = bool(deepseek) and write and servers.lacks(o.python, "deep_gemm")
        tag = str(os.getpid())
        for i, (v, label) in enumerate((v, label) for v in plan.variants for label in self.labels):
            port = base + 10 * i
            self.ipc[(v, label)] = P.ipc_name(tag, v, label)
            env = {**self.extra_env, **P.server_env(plan, label, v, self.ipc[(v, label)])}
            if label in deepseek:
                env.setdefault("SGLANG_ENABLE_JIT_DEEPGEMM", "false")
            model = plan.model(label).path(self.out / "models", write)
            args = P.server_args(plan, label, v, model, port, self.extra_flags)
            tree = o.pristine_path if P.VARIANTS[v].tree == "pristine" else o.patched_path
            self.servers[(v, label)] = servers.local_server(
                o.python, args, port, self.logs / f"{v}-{label}.log", env, tree, paths=[str(matrix.PLUGIN)],
                gpus=o.gpu, standin=standin and label in deepseek)

    def members(self, variant: str) -> dict[str, servers.Server]:
        return {label: self.servers[(variant, label)] for label in self.labels}

    def ensure_up(self, variant: str) -> bool:
        """The variant's servers answering (started, checked, warmed up), or False (why in
        self.failed). Fleet "all": every variant starts at the first call; "variant": the
        others stop first."""
        if variant in self.up:
            return True
        if variant in self.failed:
            return False
        if self.plan.fleet == "variant":
            for v in list(self.up):
                servers.stop_all(self.members(v).values())
                self.up.discard(v)
            group = [variant]
        else:
            group = [v for v in self.plan.variants if v not in self.up and v not in self.failed]
        self.set_status(stage=f"starting {', '.join(group)}")
        self.log(f"starting {', '.join(group)}: {len(group) * len(self.labels)} servers")
        began = time.time()
        fleet = {f"{v}/{label}": self.servers[(v, label)] for v in group for label in self.labels}
        for s in fleet.values():
            if not s.starts:            # a run's logs begin empty; a restart (fleet "variant") appends
                s.log.write_text("")
        offsets = {name: s.log.stat().st_size for name, s in fleet.items()}
        why = servers.start_all(fleet, self.opts.ready_timeout)
        budgets = P.budgets(self.plan)
        for name, s in fleet.items():
            v, label = name.split("/", 1)
            text = read_from(s.log, offsets[name])
            scan = judge.scan_log(text)
            b = budgets[(v, label)]
            self.record({"type": "server", "label": name, "variant": v, "model": label,
                         "event": "not ready" if why[name] else "ready", "why": why[name],
                         **summary.log_facts(text), "planned_tokens": b.device_tokens, "planned_host_gb": b.host_gb,
                         "planned_cached_tokens": b.cached_tokens,
                         "kvcached_lines": scan["kvcached_lines"], "weights_redrawn": scan["weights_redrawn"],
                         "error": scan["error"], "start_s": round(time.time() - began, 1), "port": s.port,
                         "command": s.command, "env": s.env, "log": str(s.log)})
        for v in group:
            down = [f"{label}: {why[f'{v}/{label}']}" for label in self.labels if why[f"{v}/{label}"]]
            if down:
                self.failed[v] = "servers not ready (" + "; ".join(down) + ")"
                servers.stop_all(self.members(v).values())
            else:
                self.up.add(v)
        self.log("up: " + ", ".join(sorted(self.up)) + ("; failed: " + ", ".join(self.failed) if self.failed else ""))
        for v in group:
            if v in self.up:
                self.warm_up(v)
        if P.BASELINE in self.up and not self.reference_done:
            self.reference()
        return variant in self.up

    def flush(self, server: servers.Server) -> bool:
        try:
            server.post("/flush_cache?timeout=30", {}, timeout=90)
            return True
        except servers.UNREACHABLE:
            return False

    def run_phase(self, variant: str, phase: str, tags: dict, duration: float | None = None, record=None) -> dict:
        n = len(self.labels)
        schedules = {label: traffic.arrivals(self.plan, phase, i, n, self.catalogues[label], f"{self.plan.seed}/{i}",
                                             duration) for i, label in enumerate(self.labels)}
        bases = {label: s.base for label, s in self.members(variant).items()}
        return until_done(traffic.run_phase(bases, schedules, self.catalogues, self.plan, record or self.record,
                                               tags))

    def warm_up(self, variant: str) -> None:
        """Even load for warmup_s, not measured (the first requests after a start pay one-off
        costs: kernels compiled for new shapes, the allocator's first growth), then a flush."""
        if self.plan.warmup_s <= 0:
            return
        answers = []
        self.run_phase(variant, "even", {"role": "warmup"}, self.plan.warmup_s, answers.append)
        flushed = all(self.flush(s) for s in self.members(variant).values())
        self.record({"type": "warmup", "variant": variant, "requests": len(answers),
                     "errors": sum(a.get("outcome") != "ok" for a in answers), "flushed": flushed})

    def reference(self) -> None:
        """(b)'s native servers answer the sample alone, each from an empty cache."""
        for label, s in self.members(P.BASELINE).items():
            self.flush(s)
            done = until_done(traffic.solo(s.base, self.samples[label], self.plan, self.record,
                                              {"role": "reference", "variant": P.BASELINE, "model": label}))
            self.record({"type": "reference", "model": label, **done})
        self.reference_done = True

    def sample(self, rnd: int) -> None:
        """(d)'s servers answer the sample alone, one model after another, each from an
        empty cache while the other models' servers take even load."""
        n = len(self.labels)
        for label, s in self.members(P.PRODUCT).items():
            self.flush(s)
            seconds = max(30.0, 2.0 * len(self.samples[label]))
            background = {other: (self.servers[(P.PRODUCT, other)].base,
                                  traffic.arrivals(self.plan, "even", j, n, self.catalogues[other],
                                                   f"{self.plan.seed}/{j}", seconds), self.catalogues[other])
                          for j, other in enumerate(self.labels) if other != label}
            done = until_done(traffic.solo(s.base, self.samples[label], self.plan, self.record,
                                              {"role": "sample", "round": rnd, "variant": P.PRODUCT, "model": label},
                                              background))
            self.record({"type": "sample", "round": rnd, "model": label, **done})
        wrong = summary.correctness(self.events)["mismatches"]
        if wrong:
            self.log(f"MISMATCH: {len(wrong)} of (d)'s sample answers so far differ from the native reference's")

    # ---- the ballast -------------------------------------------------------------------

    def start_ballast(self, variant: str) -> dict:
        """The ballast for a kvcached variant's slot (ballast.Holder), sized by what the
        variant's pools hold now: what it said, with "error" where it holds nothing."""
        mapped = kvc.mapped_bytes(self.opts.shm_dir, [self.ipc[(variant, label)] for label in self.labels])
        return self.ballast.start(self.opts.python, self.plan.budget_bytes, mapped, self.plan.gpu_utilization,
                                  self.opts.gpu, self.logs / "ballast.log", self.opts.ready_timeout)

    # ---- slots -------------------------------------------------------------------------

    def slot(self, rnd: int, position: int, variant: str) -> None:
        o, plan = self.opts, self.plan
        began = time.time()
        where = {"round": rnd, "position": position, "variant": variant}
        self.set_status(stage="slot", **where)
        if o.deadline is not None and began - self.started > o.deadline:
            self.record({"type": "slot", **where, "status": "not run", "why": f"--deadline {o.deadline:g} s had passed"})
            return
        if not self.ensure_up(variant):
            self.record({"type": "slot", **where, "status": "not run", "why": self.failed[variant]})
            self.save()
            return
        flush_failed = [f"{v}/{label}" for v in self.up for label, s in self.members(v).items() if not self.flush(s)]
        time.sleep(o.settle_s)      # kvcached gives freed pages back in the background
        offsets = {label: s.log.stat().st_size for label, s in self.members(variant).items()}
        held = None
        try:
            if P.VARIANTS[variant].kvcached:
                held = self.start_ballast(variant)
                self.record({"type": "ballast", **where, **held})
                if "error" in held:
                    self.record({"type": "slot", **where, "status": "not run", "why": f"ballast: {held['error']}",
                                 "ballast": held})
                    self.save()
                    return
            for phase in plan.phases:
                if not P.runs_in(plan, phase, rnd):
                    continue
                self.set_status(stage="phase", phase=phase)
                done = self.run_phase(variant, phase, {"role": "load", **where, "phase": phase})
                self.record({"type": "phase", **where, "phase": phase, **done})
                self.log(f"round {rnd + 1} {variant} {phase}: {sum(done['arrivals'].values())} requests in "
                         f"{done['duration']:.1f} s")
            if variant == P.PRODUCT:
                self.set_status(stage="sample")
                self.sample(rnd)
        finally:
            died = self.ballast.stop()
        retractions = {label: summary.log_retractions(read_from(s.log, offsets[label]))
                       for label, s in self.members(variant).items()}
        self.record({"type": "slot", **where, "status": "done", "seconds": round(time.time() - began, 1),
                     "log_retractions": retractions, "flush_failed": flush_failed, "ballast": held,
                     **({"ballast_exited": died} if died else {})})
        self.save()

    def stop_all(self, *_) -> None:
        """SIGTERM/SIGINT: stop at once; run() stops the servers and writes the report."""
        if self.stopping:
            return
        self.stopping = True
        raise Interrupted()

    def run(self) -> int:
        o, plan = self.opts, self.plan
        environment = {**servers.machine(o.python, o.patched_path), "server_flags": [*plan.server_flags,
                                                                                      *self.extra_flags],
                       "env": self.extra_env, "trees": self.trees}
        self.plan_servers(o.port or servers.free_port_block(len(plan.variants) * len(self.labels)))
        self.record({"type": "run", "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:],
                     "config": config_of(plan, o, self.extra_flags, self.extra_env), "environment": environment,
                     "patches": project.patches_state()})
        self.set_status(stage="start")
        try:
            for rnd, order in enumerate(bench_server.round_orders(list(plan.variants), plan.rounds)):
                for position, variant in enumerate(order):
                    self.slot(rnd, position, variant)
            self.record({"type": "done"})
        except Interrupted:
            self.record({"type": "interrupted"})
        finally:
            self.ballast.stop()
            servers.stop_all(self.servers.values())
        report = self.save()
        self.set_status(stage="done", done=True, problems=len(report["problems"]))
        print(summary.render(report), end="")
        return 1 if report["problems"] else 0


def read_from(path: Path, offset: int) -> str:
    """A log's text from a byte offset (what a server wrote since then)."""
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read().decode(errors="replace")


def until_done(coroutine):
    """Run a coroutine of traffic.py to its end (its own event loop)."""
    import asyncio

    return asyncio.run(coroutine)


def config_of(plan: P.Plan, opts, flags: list[str], env: dict) -> dict:
    return {"plan": P.as_dict(plan), "preset": opts.preset, "labels": plan.labels,
            "budgets": {f"{v}/{label}": asdict(b) for (v, label), b in P.budgets(plan).items()},
            "totals": P.variant_totals(plan), "working_set": plan.working_set(), "server_flags": flags, "env": env,
            "gpu": opts.gpu}


def write_report(report: dict, out: Path) -> list[Path]:
    """report.json, summary.md and, with matplotlib, ttft.png under out."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out / "report.json")
    (out / "summary.md").write_text(summary.render(report))
    written = [out / "report.json", out / "summary.md"]
    if summary.plot(report, out / "ttft.png"):
        written.append(out / "ttft.png")
    return written


# ---- options -----------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BadInput(message)


def options(argv=None):
    ap = Parser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=__doc__)
    ap.add_argument("--preset", default="two-mha", choices=sorted(P.PRESETS), help="the plan to start from")
    ap.add_argument("--plan", metavar="JSON", help="a file holding a JSON object of plan fields over the preset's")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                    help='a plan field, e.g. rounds=3, phases=\'["bursts"]\', fleet=\'"variant"\'')
    ap.add_argument("--dry-run", action="store_true", help="print the servers' commands, environments and budgets")
    ap.add_argument("--rebuild", metavar="JOURNAL", help="report.json, summary.md (and the plot) again from a journal")
    ap.add_argument("--render", metavar="REPORT", help="print a report's markdown (report.json or a journal)")
    ap.add_argument("--out", help="the run's folder (default build/sharing/<preset>; with --rebuild: the journal's)")
    ap.add_argument("--pristine-path", help="folder holding SGLang 0.5.20's sglang/ as released (harness/trees.sh)")
    ap.add_argument("--patched-path", help="folder holding sglang/ with the series applied")
    ap.add_argument("--python", default=sys.executable, help="the servers' (and the ballast's) interpreter")
    ap.add_argument("--server-flags", action="append", default=[], help="more launch_server flags for every server")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="more environment, every server")
    ap.add_argument("--gpu", default="0", help="CUDA_VISIBLE_DEVICES of every server and the ballast (one GPU)")
    ap.add_argument("--port", type=int, help="first port (default: a free block)")
    ap.add_argument("--ready-timeout", type=float, default=900, help="seconds for the servers to start")
    ap.add_argument("--deadline", type=float, help="start no slot after this many seconds (it is 'not run')")
    ap.add_argument("--shm-dir", default=kvc.SHM_DIR, help="where kvcached keeps its per-instance counters")
    ap.add_argument("--settle-s", type=float, default=2.0,
                    help="seconds between a slot's flush and the ballast's measure (kvcached unmaps in the background)")
    ap.add_argument("--gpu-memory-gib", type=float, help="the dry run's memory estimate (default: nvidia-smi's, else 80)")
    ap.add_argument("--detach", action="store_true", help="run in the background (new session), log to OUT/run.log")
    opts = ap.parse_args(argv)
    if opts.rebuild or opts.render:
        return opts, None
    plan = P.PRESETS[opts.preset]
    overrides = {}
    if opts.plan:
        try:
            overrides = json.loads(Path(opts.plan).read_text())
        except (OSError, ValueError) as exc:
            raise BadInput(f"--plan {opts.plan}: {exc}") from None
        if not isinstance(overrides, dict):
            raise BadInput(f"--plan {opts.plan}: not a JSON object of plan fields")
    for pair in opts.set:
        key, sep, value = pair.partition("=")
        if not sep:
            raise BadInput(f"--set {pair!r}: FIELD=JSON")
        try:
            overrides[key] = json.loads(value)
        except ValueError:          # a bare word: a string (fleet=variant)
            overrides[key] = value
    try:
        plan = P.plan_from(plan, overrides)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if why := P.problems(plan):
        raise BadInput("; ".join(why))
    try:
        servers.parse_env(opts.env)
        servers.split_flags(opts.server_flags)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    opts.out = opts.out or str(project.ROOT / "build" / "sharing" / opts.preset)
    if not opts.dry_run and not (opts.pristine_path and opts.patched_path):
        raise BadInput("--pristine-path and --patched-path are needed: folders holding sglang/ (harness/trees.sh)")
    if why := project.make_out(opts.out, folder=True):
        raise BadInput(why)
    return opts, plan


def gpu_memory(opts) -> int:
    if opts.gpu_memory_gib:
        return int(opts.gpu_memory_gib * P.GIB)
    for line in servers.gpus():
        try:
            return int(float(line.split(",")[2].split()[0]) * (1 << 20))    # memory.total, MiB
        except (IndexError, ValueError):
            continue
    return 80 * P.GIB


def dry_run(opts, plan: P.Plan) -> int:
    run = Run.__new__(Run)
    run.opts, run.plan, run.out, run.labels = opts, plan, Path(opts.out), plan.labels
    run.logs = run.out / "logs"
    run.extra_flags, run.extra_env = servers.split_flags(opts.server_flags), servers.parse_env(opts.env)
    run.servers, run.ipc = {}, {}
    opts.pristine_path = opts.pristine_path or "PRISTINE"
    opts.patched_path = opts.patched_path or "PATCHED"
    run.plan_servers(opts.port or 30000, write=False)
    gib = lambda x: f"{x / P.GIB:.2f} GiB"
    print(f"# preset {opts.preset}: {', '.join(plan.labels)}; variants {', '.join(plan.variants)}; "
          f"fleet {plan.fleet}")
    for v in plan.variants:
        var = P.VARIANTS[v]
        print(f"\n# ({var.letter}) {v}: {var.what}; SGLang from the {var.tree} tree")
        for label in plan.labels:
            s = run.servers[(v, label)]
            print(" ".join(f"{k}={x}" for k, x in s.env.items()) + " " + shlex.join(s.command))
    print("\n# budgets (KV budget of a variant: " + gib(plan.budget_bytes) + ")")
    for (v, label), b in P.budgets(plan).items():
        print(f"{v:17} {label:24} --max-total-tokens {b.device_tokens:>8}  KV alone {gib(b.kv_bytes):>11}  "
              f"--hicache-size {b.host_gb if b.host_gb is not None else '-'}  "
              f"KVCACHED_MAX_CACHED_TOKENS {b.cached_tokens if b.cached_tokens is not None else '-'}")
    for v, t in P.variant_totals(plan).items():
        how = "left free by the ballast" if P.VARIANTS[v].kvcached else "the static shares"
        print(f"total {v:17} KV {gib(t['kv_bytes'])} ({how}), host {t['host_gb']:g} GB")
    print(f"ballast (kvcached variants, each slot): held = free - total x (1 - {plan.gpu_utilization:g}) "
          f"- ({plan.budget_bytes} - the variant's mapped bytes)")
    mem = P.memory_estimate(plan, gpu_memory(opts))
    verdict = "fits" if mem["fits"] else "DOES NOT FIT (fleet 'variant', or a smaller budget)"
    print(f"\n# memory, about: {mem['servers']} servers up at once need {gib(mem['need_bytes'])} of "
          f"{gib(mem['gpu_bytes'])}: {verdict}")
    print(f"# traffic: working set {plan.working_set()} tokens a model; the longest prompt {plan.longest_prompt()}")
    for phase in plan.phases:
        counts = [len(traffic.arrivals(plan, phase, i, len(plan.labels), run_catalogue(plan, label, i),
                                       f"{plan.seed}/{i}")) for i, label in enumerate(plan.labels)]
        print(f"  {phase}: {plan.phase_s:g} s, requests a model {counts}")
    for note in P.notes(plan):
        print(f"note: {note}")
    print(f"# about {P.duration_estimate(plan) / 60:.0f} minutes")
    return 0


def run_catalogue(plan: P.Plan, label: str, index: int) -> traffic.Catalogue:
    return traffic.build_catalogue(plan, plan.model(label).vocab_size, f"{plan.seed}/{index}")


def detach(argv: list[str], out: Path) -> int:
    log = out / "run.log"
    args = [a for a in argv if a != "--detach"]
    with open(log, "w") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "harness.sharing", *args], stdout=handle,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    print(f"sharing run in the background: pid {proc.pid}\n  log {log}\n  status {out / 'status.json'} "
          f"(\"done\": true at the end)\n  report {out / 'report.json'}, journal {out / 'journal.jsonl'}", flush=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        opts, plan = options(argv)
        if opts.render or opts.rebuild:
            path = Path(opts.render or opts.rebuild)
            try:
                report = summary.load(path)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise BadInput(f"{path}: not a sharing report or journal it can read ({type(exc).__name__}: {exc})") \
                    from None
            if opts.render:
                print(summary.render(report), end="")
                return 0
            out = Path(opts.out) if opts.out else path.parent
            if why := project.make_out(out, folder=True):
                raise BadInput(why)
            written = write_report(report, out)
            print("wrote " + ", ".join(map(str, written))
                  + ("" if len(written) > 2 else " (no plot: matplotlib is not installed)"))
            return 0
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if opts.dry_run:
        return dry_run(opts, plan)
    if opts.detach:
        return detach(argv, Path(opts.out))
    try:
        trees = project.check_trees(opts.pristine_path, opts.patched_path)
    except SystemExit as exc:       # a tree that is not what its name says: bad input
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run = Run(opts, plan, trees)
    return servers.with_signals(run.stop_all, run.run)
