"""Model-level check: SGLang 0.5.20's real server, native vs kvcached, every pool kind.

    python -m harness.compare --pool all --launcher local \\
        --pristine-path P --patched-path Q [--gpus 0,1] [--jobs 6] [--l3 also] \\
        [--l3-store mooncake [--shared-store]] [--server-flags "..."] [--env K=V ...] --out build/e2e/report.json
    python -m harness.compare --case qwen2.5-7b --launcher docker      (the images)
    python -m harness.compare --table build/e2e/report.json            (markdown rows)

Each row of the matrix (matrix.build_rows) is one server: a model case, a host
layout (`--hicache-mem-layout`), L3 off or on, and a variant: `native`
(SGLang 0.5.20 as released, kvcached off: the oracle), `elastic-<layout>` (the series,
kvcached on in that layout), `pristine-<layout>` (SGLang 0.5.20 as released with
kvcached on: the failure the series fixes, expected and recorded, not an error). Every
server gets SGLang's default HiCache flags plus the row's, the same traffic
(matrix.traffic: a prompt set with shared and distinct prefixes, filler that pushes
it out of the device pool (L3: out of host memory too), the set again), and is judged
against its group's native run (verdict.py): greedy tokens and top-5 logprobs
(tolerance --logprob-tol, default 0: bit-identical), device/host/storage hit tokens per
prompt, and kvcached's allocation line in the log. The L3 store (--l3-store) is SGLang's
file store (a fresh folder per server) or Mooncake: a mooncake_master on loopback
(harness/mooncake_store.py) for each row, started before its server and stopped after it (also
on SIGTERM or Ctrl-C), the server a client under the row's tag; --shared-store adds rows
of two servers of one master under one tag, a writer (pass 1, filler) and, while it
runs, a reader (pass 2) that must answer from what the writer stored. Dummy-weight servers get
harness/compare/plugin on their path, an SGLang plugin that draws the dummy weights at a trained
model's scale (SGLang's own, U(-1e-3, 1e-3), leave the KV cache without effect on any
logprob); their log must show it ran. Passes never use /flush_cache: in
SGLang 0.5.20 it also clears the host pool, so nothing would load from host.

Launchers: `local` starts `python -m sglang.launch_server` on this host with the tree's
folder first on PYTHONPATH (--pristine-path / --patched-path hold an `sglang/` package:
harness/trees.sh makes both from an installed SGLang 0.5.20); `docker` runs the images
(--native-image: SGLang's official image; --patched-image: this project's; a pristine
variant needs --pristine-kvcached-image). The JSON report holds every row, its server
command and environment, the environment of the run and the patches/ state.
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from harness import mooncake_store, project, servers
from harness.compare import matrix
from harness.compare import verdict as judge
from harness.rig.real_kernels import sgl_kernel_calls


def generate(server: servers.Server, ids: list[int], plan: matrix.Plan, timeout: float) -> dict:
    payload = {"input_ids": ids,
               "sampling_params": {"temperature": 0.0, "max_new_tokens": plan.max_new_tokens, "ignore_eos": True},
               "return_logprob": True, "top_logprobs_num": plan.top_logprobs, "logprob_start_len": -1}
    return judge.summarize(server.post("/generate", payload, timeout))


class RunStopped(Exception):
    """stop_all ran while a row was starting its master or a server."""


class Runner:
    """Runs rows, several at a time, each on its own port and GPU(s)."""

    def __init__(self, opts, plan: matrix.Plan):
        self.opts, self.plan = opts, plan
        self.gpus = [g for g in opts.gpus.split(",") if g]
        self.slots = list(range(opts.jobs))
        self.port = opts.port or servers.free_port_block(opts.jobs)   # slot n: port + 10 n
        self.lock = threading.Lock()
        self.started = time.time()
        self.logs = Path(opts.logs or Path(opts.out).with_suffix("").as_posix() + "-logs")
        self.logs.mkdir(parents=True, exist_ok=True)
        self.extra_flags = servers.split_flags(opts.server_flags)
        self.extra_env = servers.parse_env(opts.env)
        # SGLang's DeepSeek and EAGLE paths import deep_gemm: the import-only stand-in
        # (harness/rig/README.md) last on a local server's path where the interpreter lacks it
        self.standin = opts.launcher == "local" and servers.lacks(opts.python, "deep_gemm")
        self.live: set[servers.Server] = set()
        self.master_binary: Path | None = None    # --l3-store mooncake: each such row's master
        self.masters: set[mooncake_store.MooncakeMaster] = set()
        self.stopping = False
        # each finished row at once, so that a run cut short keeps what it did
        self.journal = Path(opts.out).with_suffix(".rows.jsonl")
        self.journal.write_text("")

    def stop_all(self, *_) -> None:
        """On SIGTERM/SIGINT: start no more rows, stop every server still running, exit."""
        self.stopping = True
        servers.stop_all(list(self.live))      # side by side: each may wait out its grace
        for master in list(self.masters):
            master.stop()
        raise SystemExit(f"stopped; finished rows are in {self.journal}")

    def image(self, variant: matrix.Variant) -> str | None:
        if variant.tree == "patched":
            return self.opts.patched_image
        return self.opts.native_image if variant.kvcached is None else self.opts.pristine_kvcached_image

    def record(self, row: matrix.Row) -> dict:
        return {"key": row.key, "group": row.group, "case": row.case.name, "model": row.case.model,
                "pool": row.case.pool, "tp": row.case.tp, "pp": row.case.pp,
                "variant": row.variant.name, "tree": row.variant.tree,
                "kvcached": row.variant.kvcached, "host_layout": row.host_layout, "l3": row.l3,
                "l3_store": row.l3_store if row.l3 else None,
                "io_backend": row.io_backend,
                "shared": row.shared,
                "expect": row.expect, "refusal": row.refusal, "dummy": row.case.dummy,
                "draft": row.case.draft, "models_per_rank": 2 if row.case.draft else 1}

    def skip_reason(self, row: matrix.Row) -> str:
        if row.not_run:
            return row.not_run
        if self.stopping:
            return "the run was stopped"
        if row.case.gpus > len(self.gpus):
            return f"needs {row.case.gpus} GPUs, --gpus names {len(self.gpus)}"
        if self.opts.launcher == "docker" and not self.image(row.variant):
            return "no image for this variant (--pristine-kvcached-image)"
        if self.opts.deadline and time.time() - self.started > self.opts.deadline:
            return f"--deadline {self.opts.deadline:.0f} s passed before it started"
        return ""

    def run(self, row: matrix.Row) -> dict:
        rec = self.record(row)
        reason = self.skip_reason(row)
        if reason:
            return {**rec, "outcome": "skipped", "reason": reason}
        with self.lock:
            slot = self.slots.pop(0)
        try:
            result = {**rec, **self.serve(row, slot)}
        except RunStopped:
            result = {**rec, "outcome": "skipped", "reason": "the run was stopped"}
        except mooncake_store.MasterError as exc:
            result = {**rec, "outcome": "skipped" if self.stopping else "store failed", "error": str(exc),
                      **({"reason": "the run was stopped"} if self.stopping else {})}
            self.done(row, result)
        except Exception as exc:  # a defect of the harness in one row must not lose the other rows
            stem = row.key.replace("/", "__")    # the row's server and master logs, as launched() names them
            result = {**rec, "outcome": "harness error", "error": f"{type(exc).__name__}: {exc}",
                      "logs": [str(p) for p in sorted(self.logs.glob(stem + ".*log"))]}
            print(f"[{time.time() - self.started:6.0f} s] done  {row.key}: harness error\n"
                  + traceback.format_exc(), end="", flush=True)
        finally:
            with self.lock:
                self.slots.append(slot)
        with self.lock, open(self.journal, "a") as journal:
            journal.write(json.dumps(result) + "\n")
        return result

    def serve(self, row: matrix.Row, slot: int) -> dict:
        port = self.port + 10 * slot
        gpus = [self.gpus[(slot + i) % len(self.gpus)] for i in range(row.case.gpus)]
        with self.row_store(row) as store:
            if row.shared:
                return self.serve_pair(row, port, gpus, store)
            with self.launched(row, port, gpus, store) as (server, result):
                if not result.get("outcome"):
                    passes = self.served(server, result, lambda: self.traffic(server, row))
                    if result["outcome"] == "served":
                        result["passes"] = passes
        self.done(row, result)
        return result

    @contextlib.contextmanager
    def row_store(self, row: matrix.Row):
        """A Mooncake L3 row's own mooncake_master (None for any other row), running while
        its servers do. Not one for the run: the store puts an object in any client's memory
        segment, so a server of another row that stops takes this row's objects with it (on
        the H200, writes and the shared pairs' reads failed so, natively too)."""
        if not (row.l3 and row.l3_store == "mooncake"):
            yield None
            return
        log = self.logs / (row.key.replace("/", "__") + ".mooncake_master.log")
        log.write_text("")          # this run's master only
        with self.master(log) as master:
            yield master

    @contextlib.contextmanager
    def master(self, log: Path):
        """A mooncake_master running, which stop_all stops too."""
        master = mooncake_store.MooncakeMaster(log, self.master_binary)
        with self.lock:
            self.masters.add(master)
        try:
            with master.running():
                if self.stopping:
                    raise RunStopped()
                yield master
        finally:
            with self.lock:
                self.masters.discard(master)

    def serve_pair(self, row: matrix.Row, port: int, gpus: list[str], store) -> dict:
        """A shared-store row: the writer serves pass 1 and the filler; the reader, under
        the same tag, pass 2. The writer runs until the reader is done: a Mooncake client's
        objects live in the memory segment it gives the store, and go with it. The reader
        takes the GPUs after the writer's in --gpus (the same ones where there are no more)."""
        passes: dict = {}
        with self.launched(row, port, gpus, store, "writer") as (writer, result):
            if not result.get("outcome"):
                passes = self.served(writer, result, lambda: self.traffic(writer, row, ("pass1", "filler")))
            if result["outcome"] == "served":
                after = [self.gpus[(self.gpus.index(gpus[-1]) + 1 + i) % len(self.gpus)] for i in range(len(gpus))]
                with self.launched(row, port + 5, after, store, "reader") as (reader, result["reader"]):
                    if not result["reader"].get("outcome"):
                        passes.update(self.served(reader, result["reader"],
                                                  lambda: self.traffic(reader, row, ("pass2",))))
        reader = result.get("reader")
        if reader and reader["outcome"] != "served":   # the row's outcome and error: the pair's
            result["outcome"], result["error"] = "reader " + reader["outcome"], reader.get("error", "")
        if result["outcome"] == "served":
            result["passes"] = passes
        self.done(row, result)
        return result

    def done(self, row: matrix.Row, result: dict) -> None:
        print(f"[{time.time() - self.started:6.0f} s] done  {row.key}: {result['outcome']} "
              f"{result.get('error', '')[:120]}", flush=True)

    def store_tag(self, row: matrix.Row, role: str) -> str:
        """A Mooncake L3 server's tag: the row's, for both servers of a shared-store pair."""
        return matrix.store_tag(row)

    @contextlib.contextmanager
    def launched(self, row: matrix.Row, port: int, gpus: list[str], store=None, role: str = ""):
        """Start one server of the row and wait for it; yield it and its record (with an
        `outcome` already where it never got ready); on leaving, stop it, remove its file
        store and add what its log says. `store`: the row's mooncake_master (row_store);
        `role`: writer or reader of a shared-store row, which share the row's Mooncake tag."""
        if self.stopping:       # stop_all ran while this row was starting: no new server
            raise RunStopped()
        opts, plan = self.opts, row.case.plan_of(self.plan)
        tag = self.store_tag(row, role) if row.l3 and row.l3_store == "mooncake" else None
        flags = matrix.server_args(row, port, plan, [*self.extra_flags, "--nccl-port", str(port + 1)], store, tag)
        storage = None
        if row.l3 and row.l3_store == "file":
            storage = (tempfile.mkdtemp(prefix="e2e-l3-") if opts.launcher == "local"
                       else f"/tmp/e2e-l3-{port}")
        env = {**self.extra_env, **matrix.server_env(row, storage, role)}
        plugins = [str(matrix.PLUGIN)] if row.case.dummy else []
        mounts = (row.case.model, *plugins) if row.case.dummy else ()
        if opts.launcher == "docker" and plugins:
            env["PYTHONPATH"] = ":".join(plugins)
        log = self.logs / (row.key.replace("/", "__") + (f".{role}" if role else "") + ".log")
        log.write_text("")          # this run's log only: the verdict reads its error lines
        if opts.launcher == "local":
            tree = opts.pristine_path if row.variant.tree == "pristine" else opts.patched_path
            server = servers.local_server(opts.python, flags, port, log, env, tree, plugins, ",".join(gpus),
                                          self.standin)
        else:
            server = servers.Server(servers.launch_command(opts.launcher, opts.python, self.image(row.variant), env,
                                                           flags, gpus, mounts,
                                                           name=f"sglang-e2e-{port}-{uuid.uuid4().hex[:12]}"),
                                    port, log, env)
        command = server.command
        print(f"[{time.time() - self.started:6.0f} s] start {row.key}{' ' + role if role else ''} "
              f"(GPU {','.join(gpus)}, port {port})", flush=True)
        result = {"command": command, "env": env, "gpus": gpus, "log": str(log),
                  **({"store_tag": tag, "mooncake_master": store.master_address,
                      "mooncake_master_log": str(store.log_path)} if tag else {})}
        began = time.time()
        server.start()
        self.live.add(server)
        try:
            why = server.wait_ready(opts.ready_timeout)
            result["start_s"] = round(time.time() - began, 1)
            if why:
                result["outcome"] = why
            yield server, result
        finally:
            server.stop()
            self.live.discard(server)
            if storage and opts.launcher == "local":
                shutil.rmtree(storage, ignore_errors=True)
            result.update(judge.scan_log(server.log_text()))

    def served(self, server: servers.Server, result: dict, send) -> dict:
        """Run `send()` (the traffic) on a ready server: its outcome and run time into
        `result`; what it returned, {} where a request failed."""
        began = time.time()
        passes = {}
        try:
            passes = send()
            result["outcome"] = "served"
        except (*servers.UNREACHABLE, KeyError) as exc:
            result["outcome"] = "died serving" if server.wait_exit(20) else "request failed"
            result["request_error"] = f"{type(exc).__name__}: {exc}"
        result["run_s"] = round(time.time() - began, 1)
        return passes

    def traffic(self, server: servers.Server, row: matrix.Row, parts=("pass1", "filler", "pass2")) -> dict:
        requests = None
        if row.case.prompts:  # real text, tokenized with the checkpoint's own tokenizer
            from harness import checkpoint
            requests = checkpoint.tokenized_requests(Path(row.case.prompts), Path(row.case.model))
        plan = row.case.plan_of(self.plan)
        t = matrix.traffic(plan, row.case.vocab_size, row.l3, requests)
        timeout = self.opts.request_timeout
        passes = {}
        for part in parts:   # in this order: the filler's answers are not kept
            answers = [generate(server, ids, plan, timeout) for ids in getattr(t, part)]
            if part != "filler":
                passes[part] = answers
        return passes


def environment(opts) -> dict:
    """What ran: GPU, driver, Python and the versions the servers import, stand-ins named."""
    if opts.launcher == "local":
        env = servers.machine(opts.python, opts.patched_path)
    else:
        env = {"python": platform.python_version(), "launcher": opts.launcher, "gpus": servers.gpus(),
               "images": {"native": opts.native_image, "patched": opts.patched_image,
                          "pristine+kvcached": opts.pristine_kvcached_image}}
    env["server_flags"] = opts.server_flags
    env["env"] = opts.env
    return env


def read_rows(path: Path, logprob_tol: float) -> list[dict]:
    """The rows of a report or of a run's journal (either gzipped or not), judged again
    from their raw runs; a journal's torn last line (its run was killed writing it) left out."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    if path.name.removesuffix(".gz").endswith(".jsonl"):
        lines = [line for line in text.splitlines() if line.strip()]
        rows = [json.loads(line) for line in lines[:-1]]
        with contextlib.suppress(json.JSONDecodeError):
            rows += [json.loads(line) for line in lines[-1:]]
    else:
        rows = json.loads(text)["rows"]
    judge.judge(rows, logprob_tol)
    return rows


def options(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--table", nargs="+", metavar="REPORT",
                    help="judge reports (or a run's .rows.jsonl journal) again, print their table, exit")
    ap.add_argument("--list", action="store_true", help="print the rows that would run and exit")
    ap.add_argument("--case", nargs="+", default=[], choices=sorted(matrix.CASES))
    ap.add_argument("--pool", nargs="+", default=[], choices=[*matrix.POOL_KINDS, "all"],
                    help="every case of these pool kinds in --set")
    ap.add_argument("--set", dest="case_set", choices=sorted(matrix.CASE_SETS), default="tiny")
    ap.add_argument("--host-layout", nargs="+", default=list(matrix.HOST_LAYOUTS), choices=matrix.HOST_LAYOUTS)
    ap.add_argument("--variants", nargs="+", default=list(matrix.DEFAULT_VARIANTS), choices=sorted(matrix.VARIANTS))
    ap.add_argument("--io-backend", nargs="+", default=list(matrix.IO_BACKENDS[:1]), choices=matrix.IO_BACKENDS,
                    help="--hicache-io-backend of the rows (direct: page_first runs as page_first_direct)")
    ap.add_argument("--l3", choices=matrix.L3_MODES, default="off", help="L3 groups: none, also, only")
    ap.add_argument("--l3-store", choices=matrix.L3_STORES, default="file",
                    help="the L3 rows' store: SGLang's file store, or a Mooncake master this run starts")
    ap.add_argument("--shared-store", action="store_true",
                    help="with --l3-store mooncake: also pairs of servers under one tag, a writer (pass 1, "
                         "filler) and a reader (pass 2) that must answer from what the writer stored")
    ap.add_argument("--mooncake-master", metavar="PATH",
                    help="the mooncake_master binary (default: the one in the mooncake package --python imports)")
    ap.add_argument("--skip", nargs="+", default=[], metavar="GLOB",
                    help="leave out rows whose key matches, e.g. '*-tp2/layer_first/*' '*/l3/*'")
    ap.add_argument("--launcher", choices=["docker", "local"], default="docker")
    ap.add_argument("--python", default=sys.executable, help="local launcher: the interpreter of the servers")
    ap.add_argument("--pristine-path", help="local: folder holding SGLang 0.5.20's sglang/ as released")
    ap.add_argument("--patched-path", help="local: folder holding sglang/ with the series applied")
    ap.add_argument("--native-image", default=project.official_image(),
                    help="docker: SGLang's official image (default: sglang.pin's, by digest)")
    ap.add_argument("--patched-image", default=project.project_image(), help="docker: `make image`'s tag")
    ap.add_argument("--pristine-kvcached-image", help="docker: SGLang 0.5.20 as released with kvcached 0.1.6")
    ap.add_argument("--server-flags", action="append", default=[],
                    help="more launch_server flags for every server (one string, split like a shell)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="more server environment")
    ap.add_argument("--gpus", default="0", help="GPU ids; a row of TP n takes n of them")
    ap.add_argument("--jobs", type=int, default=1, help="servers running at once (they share the GPUs)")
    ap.add_argument("--port", type=int, help="first port, 10 a server slot (default: a free block)")
    ap.add_argument("--logprob-tol", type=float, default=0.0)
    ap.add_argument("--ready-timeout", type=float, default=1800)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--deadline", type=float, help="start no row after this many seconds (it is 'not run')")
    ap.add_argument("--logs", help="server logs folder (default: next to --out)")
    ap.add_argument("--out", default="build/e2e/report.json")
    opts = ap.parse_args(argv)
    if opts.jobs < 1:
        ap.error("--jobs must be at least 1")
    try:
        servers.parse_env(opts.env)
        servers.split_flags(opts.server_flags)
    except ValueError as exc:
        ap.error(str(exc))
    if not (opts.table or opts.list) and (why := project.make_out(opts.out)):
        ap.error(why)
    return opts


def main(argv=None) -> int:
    opts = options(argv)
    if opts.table:
        for path in opts.table:
            if not Path(path).is_file():
                raise SystemExit(f"error: {path}: no such report (a report.json[.gz] or its .rows.jsonl journal)")
            try:
                print(judge.markdown_table(read_rows(Path(path), opts.logprob_tol)))
            except (OSError, EOFError, zlib.error, ValueError, KeyError, TypeError, AttributeError) as exc:
                # unreadable (not gzip, not JSON, not text) or another tool's report
                raise SystemExit(f"error: {path}: not a report or journal of this tool ({type(exc).__name__}: {exc})")
        return 0
    try:
        rows = matrix.skip_rows(matrix.build_rows(matrix.select_cases(opts.case, opts.pool, opts.case_set),
                                                  opts.host_layout, opts.variants, opts.l3, opts.io_backend,
                                                  opts.l3_store, opts.shared_store),
                                 opts.skip)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}")
    if opts.list:
        print("\n".join(f"{r.key} (expect {r.expect})" for r in rows))
        return 0
    trees = project.check_trees(opts.pristine_path, opts.patched_path) if opts.launcher == "local" else {}
    plan = matrix.Plan()
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:], "trees": trees,
              "patches": project.patches_state(), "environment": environment(opts), "plan": asdict(plan),
              "logprob_tol": opts.logprob_tol}
    runner = Runner(opts, plan)
    order = matrix.run_order(rows)
    if any(r.l3 for r in rows):
        report["l3_store"] = {"store": opts.l3_store}
    if opts.l3_store == "mooncake" and any(r.l3 and not r.not_run for r in rows):
        try:
            runner.master_binary = Path(opts.mooncake_master or mooncake_store.packaged_binary(opts.python))
            # the servers' store client (under docker: the package of this host's --python)
            report["l3_store"].update(mooncake=mooncake_store.package(opts.python),
                                      mooncake_master=str(runner.master_binary))

            def check_master():   # a master that cannot serve stops the run before any row, in one line
                with runner.master(runner.logs / "mooncake_master.log"):
                    pass
            servers.with_signals(runner.stop_all, check_master)
        except mooncake_store.MasterError as exc:
            raise SystemExit(f"error: {exc}")

    def run_all() -> dict:
        with ThreadPoolExecutor(max_workers=opts.jobs) as pool:
            return dict(zip(order, pool.map(runner.run, [rows[i] for i in order])))
    done = servers.with_signals(runner.stop_all, run_all)
    report["rows"] = [done[i] for i in range(len(rows))]
    report["problems"] = judge.judge(report["rows"], opts.logprob_tol)
    report["wall_s"] = round(time.time() - runner.started, 1)
    if os.environ.get("SGLK_REAL_LOG"):   # on sglang-kernel's real ops (harness/rig/real_kernels/setup.sh)
        report["sgl_kernel_ops"] = sgl_kernel_calls.summary(os.environ["SGLK_REAL_LOG"],
                                                            os.environ.get("SGLK_CALL_LOG"))
    Path(opts.out).write_text(json.dumps(report, indent=1))
    print(judge.markdown_table(report["rows"]))
    print("\n".join(report["problems"]) if report["problems"] else "every row as expected")
    return 1 if report["problems"] else 0

