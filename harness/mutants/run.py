"""Mutation run over the Python lines the patch series adds (``make mutants``).

    python -m harness.mutants [--jobs N] [--limit N] [--files GLOB ...] [--list]
                                 [--out build/mutants/report.json]

1. Builds its own patched tree from the series as it is now (pristine 0.5.20 from
   scripts/build-pristine, copied to build/mutants/patched, scripts/apply), never
   touching build/sglang-patched.
2. Enumerates the code lines the series adds (series_lines.py) and their one-line
   mutants (operators.py); drops the reviewed equivalent ones (equivalent.py).
3. Runs every CPU test file that runs SGLang's code (tests_for), unmutated first (a
   test failing there is deselected and reported; the times order the files fastest
   first and set each mutant's timeout), then once per mutant with -x, in ``--jobs``
   workers (worker.py), each on its own copy of the tree.
4. Writes a JSON report (per mutant: file:line, operator, the diff, killed / survived /
   timeout / not compilable, the first failing test) and prints a summary line.
Exit status: 0 when no mutant survived or timed out, 1 otherwise.
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness.mutants.equivalent import EQUIVALENT
from harness.mutants.operators import line_mutants
from harness.mutants.series_lines import series_lines
from harness.mutants.worker import module_name
from harness.project import ROOT, series_module

OUT = ROOT / "build" / "mutants"
CPU = ROOT / "tests" / "cpu"
# A CPU test file runs SGLang's code if it imports sglang (anywhere in it) or uses the
# kernel emulation's fixtures or the support modules that drive SGLang's stack; the
# others, and every file marked project_files, check this project's own files and tools.
RUNS_SGLANG = re.compile(r"^\s*(from|import) sglang\b|\b(host_modules|kernel_emulation)\b|"
                         r"tests\.support\.(controller|pp_stages|l3_storage)\b|harness\.(differential|emulation)\b", re.M)
PROJECT_FILES = re.compile(r"^pytestmark = pytest\.mark\.project_files\b", re.M)


def tests_for(path: str) -> list[str]:
    """Every CPU-tier test file (tests/cpu, tests/upstream) that runs SGLang's code: a
    mutant of any series line meets all of them (the run orders them fastest first, and
    -x stops at the first failure)."""
    files = [*CPU.glob("test_*.py"), *(ROOT / "tests" / "upstream").glob("test_*.py")]
    return sorted(str(p.relative_to(ROOT)) for p in files
                  if RUNS_SGLANG.search(p.read_text()) and not PROJECT_FILES.search(p.read_text()))


def build_trees(run_dir: Path, jobs: int) -> tuple[Path, Path, list[Path]]:
    """The pristine tree's python/, a patched copy, and one copy per worker, in run_dir."""
    pristine = Path(subprocess.run([str(ROOT / "scripts" / "build-pristine")], check=True, capture_output=True,
                                   text=True).stdout.strip()) / "python"
    patched = run_dir / "patched"
    patched.mkdir(parents=True)
    shutil.copytree(pristine, patched / "python", symlinks=True)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "apply"), str(patched)], check=True,
                   capture_output=True, text=True)
    workers = []
    for k in range(jobs):
        tree = run_dir / f"worker{k}"
        shutil.copytree(patched / "python", tree, symlinks=True)
        workers.append(tree)
    return pristine, patched / "python", workers


def enumerate_mutants(pristine: Path, patched: Path, patterns: list[str]):
    mutants, lines = [], 0
    for series_file in series_lines(pristine, patched):
        if patterns and not any(fnmatch.fnmatch(series_file.path, p) for p in patterns):
            continue
        source = (patched / series_file.path).read_text()
        tree = ast.parse(source)
        lines += len(series_file.lines)
        for n in series_file.lines:
            mutants += line_mutants(series_file.path, source, n, tree)
    return mutants, lines


def compiles(patched: Path, mutant) -> bool:
    source = (patched / mutant.path).read_text().splitlines(keepends=True)
    source[mutant.line - 1] = mutant.mutated + "\n"
    try:
        compile("".join(source), mutant.path, "exec")
    except SyntaxError:
        return False
    return True


class Worker:
    def __init__(self, tree: Path, pristine: Path):
        # the worker's copy of the tree first, then the project (the tests it runs import it)
        env = dict(os.environ, OMP_NUM_THREADS="1", PRISTINE_SGLANG=str(pristine), PYTHONDONTWRITEBYTECODE="1",
                   PYTHONPATH=os.pathsep.join([str(tree), str(ROOT)]))
        self.proc = subprocess.Popen([sys.executable, "-m", "harness.mutants.worker", str(tree)], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("a mutation worker died")
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def parallel(workers, jobs, on_result):
    pending = queue.Queue()
    for job in jobs:
        pending.put(job)

    def drain(worker):
        while True:
            try:
                job = pending.get_nowait()
            except queue.Empty:
                return
            on_result(job, worker.ask(job["job"]))

    threads = [threading.Thread(target=drain, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def baseline(workers, files: list[str], logs: Path) -> tuple[dict, set, list]:
    """Each test file once on the unmutated tree: its time, what it imports, what fails.

    A test that fails unmutated cannot judge a mutant: it is deselected from the mutant
    runs and listed in the report. A file that cannot run at all stops the run."""
    times, modules, failing, broken = {}, set(), [], []
    lock = threading.Lock()

    def record(job, result):
        with lock:
            times[job["file"]] = result["seconds"]
            modules.update(result.get("modules", ()))
            failing.extend(f for f in result["failed"] if not f.startswith("collecting"))
            if result["status"] in ("timeout", "error") or any(f.startswith("collecting") for f in result["failed"]):
                broken.append(f"{job['file']}: {result['status']} {result['failed']}")

    jobs = [{"file": f, "job": {"tests": [f], "timeout": 1800, "log": str(logs / f"baseline-{Path(f).stem}.log")}}
            for f in files]
    parallel(workers, jobs, record)
    if broken:
        raise SystemExit("the unmutated tree cannot run its tests; mutants cannot be judged:\n  " + "\n  ".join(broken))
    return times, modules, sorted(failing)


def check_harness(workers, patched: Path, paths: list[str], failing: list[str], logs: Path):
    """Two kinds of runs whose outcome is known, through the same path as the mutants.

    * A canary per file: the file made unimportable. Its tests must fail, or a mutant of
      it could not be told from the original (the tests do not run it from the tree).
    * A control: the unmutated tree, its modules unloaded and re-imported as for a
      mutant. The tests must pass, or a failure would be the harness's, not a mutant's."""
    problems, lock = [], threading.Lock()

    def record(job, result):
        expected = "killed" if job["kind"] == "canary" else "survived"
        if result["status"] != expected:
            with lock:
                problems.append(f"{job['kind']} {job['file']}: {result['status']} {result['failed'][:3]}")

    jobs = []
    for path in paths:
        lines = (patched / path).read_text().splitlines()
        jobs.append({"kind": "canary", "file": path, "job": {
            "tests": tests_for(path), "deselect": failing, "timeout": 1800, "path": path, "line": len(lines),
            "mutated": lines[-1] + "\nraise ImportError('mutation canary')",
            "log": str(logs / f"canary-{Path(path).stem}.log")}})
    lines = (patched / paths[0]).read_text().splitlines()
    jobs.insert(0, {"kind": "control", "file": paths[0], "job": {
        "tests": tests_for(paths[0]), "deselect": failing, "timeout": 3600, "path": paths[0], "line": len(lines),
        "mutated": lines[-1], "log": str(logs / "control.log")}})
    parallel(workers, jobs, record)
    if problems:
        raise SystemExit("the mutation harness is not sound here; no mutant was run:\n  " + "\n  ".join(problems))
    print(f"harness: the unmutated tree passes through it, and each of the {len(paths)} files, made "
          "unimportable, fails its tests", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    parser.add_argument("--limit", type=int, help="run an evenly spread subset of this many mutants")
    parser.add_argument("--files", nargs="*", default=[], help="only files matching these globs (sglang/...)")
    parser.add_argument("--timeout-factor", type=float, default=3.0)
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--rerun", type=Path, help="only the mutants a previous report has not seen killed")
    parser.add_argument("--out", type=Path, default=OUT / "report.json")
    args = parser.parse_args(argv)
    started = time.time()

    # Stopped with SIGTERM, still remove the trees (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # Each run works in its own folder (trees and logs), so runs never share a tree.
    run_dir = OUT / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        return run(args, run_dir, started)
    finally:
        if args.list:
            shutil.rmtree(run_dir, ignore_errors=True)
        for tree in run_dir.glob("worker*"):  # the logs stay, the trees go
            shutil.rmtree(tree, ignore_errors=True)
        shutil.rmtree(run_dir / "patched", ignore_errors=True)


def judge(runnable, trees: list[Path], pristine: Path, patched: Path, args, run_dir: Path) -> list[str]:
    """Baseline, harness check and every runnable mutant, in workers; each entry gets its
    status. Returns the tests that fail unmutated (deselected for the mutants)."""
    workers = [Worker(tree, pristine) for tree in trees]
    try:
        files = sorted({t for _, e in runnable for t in e["tests"]})
        print(f"baseline: {len(files)} test files on the unmutated tree ...", flush=True)
        times, modules, failing = baseline(workers, files, run_dir)
        print("baseline: " + ", ".join(f"{Path(f).stem} {s:.0f}s" for f, s in times.items()), flush=True)
        if failing:
            print(f"WARNING: {len(failing)} tests fail on the unmutated tree; deselected for the mutants:\n  "
                  + "\n  ".join(failing), flush=True)
        series_modules = sorted({module_name(m.path) for m, _ in runnable})
        for w in workers:
            ready = w.ask({"preload": sorted(modules), "series": series_modules})
        print(f"workers: {ready['loaded']} modules stay loaded; {ready['unloaded']} that import a series file are "
              "imported again by each mutant's run", flush=True)
        check_harness(workers, patched, sorted({m.path for m, _ in runnable}), failing, run_dir)
        worst = sum(sum(times[t] for t in e["tests"]) for _, e in runnable) / len(workers)
        print(f"{len(runnable)} mutants on {len(workers)} workers: at most {worst / 60:.0f} min if every one "
              "survived; killed ones stop at their first failing test", flush=True)
        done, lock, t0 = [0], threading.Lock(), time.time()

        def record(job, result):
            entry = job["entry"]
            entry.update(status=result["status"], seconds=result["seconds"], failed=(result["failed"] or [None])[0])
            with lock:
                done[0] += 1
                eta = (time.time() - t0) / done[0] * (len(runnable) - done[0])
                print(f"[{done[0]}/{len(runnable)}] {entry['status']:8} {entry['file']}:{entry['line']} "
                      f"[{entry['operator']}] {result['seconds']:.0f}s  eta {eta / 60:.0f} min", flush=True)

        jobs = []
        for i, (m, entry) in enumerate(runnable):
            entry["tests"].sort(key=times.get)  # fastest first
            timeout = args.timeout_factor * sum(times[t] for t in entry["tests"]) + 60
            jobs.append({"entry": entry, "job": {
                "tests": entry["tests"], "deselect": failing, "timeout": timeout, "log": str(run_dir / f"mutant-{i}.log"),
                "path": m.path, "line": m.line, "mutated": m.mutated}})
        parallel(workers, jobs, record)
    finally:
        for w in workers:
            w.close()
    return failing


def run(args, run_dir: Path, started: float) -> int:
    pristine, patched, trees = build_trees(run_dir, 0 if args.list else args.jobs)
    mutants, lines = enumerate_mutants(pristine, patched, args.files)
    equivalent = {e.key: e for e in EQUIVALENT}
    skipped = [m for m in mutants if m.key in equivalent]
    mutants = [m for m in mutants if m.key not in equivalent]
    if args.rerun:
        previous = json.loads(args.rerun.read_text())["mutants"]
        again = {(r["file"], r["original"].strip(), r["mutated"].strip()) for r in previous
                 if r["status"] not in ("killed", "not compilable")}
        mutants = [m for m in mutants if m.key in again]
    if args.limit and args.limit < len(mutants):
        step = len(mutants) / args.limit
        mutants = [mutants[int(i * step)] for i in range(args.limit)]
    print(f"{lines} added code lines, {len(mutants) + len(skipped)} mutants ({len(skipped)} listed as equivalent)"
          f"{f', running {len(mutants)}' if args.limit else ''}", flush=True)
    if args.list:
        for m in mutants:
            print(f"{m.path}:{m.line} [{m.operator}] {m.mutated.strip()}")
        return 0

    results, runnable, failing = [], [], []
    for m in mutants:
        entry = {"file": m.path, "line": m.line, "operator": m.operator, "original": m.original,
                 "mutated": m.mutated, "diff": f"-{m.original}\n+{m.mutated}", "tests": tests_for(m.path)}
        if compiles(patched, m):
            runnable.append((m, entry))
        else:
            entry.update(status="not compilable", seconds=0, failed=None)
        results.append(entry)

    # Nothing left to judge (a rerun whose mutants are all killed or listed as equivalent):
    # no baseline, no workers.
    if runnable:
        failing = judge(runnable, trees, pristine, patched, args, run_dir)

    for r in results:  # a run cut short (a worker died) leaves some unjudged
        r.setdefault("status", "error")
        r.setdefault("seconds", 0)
        r.setdefault("failed", "not run")
    counts = {s: sum(r["status"] == s for r in results) for s in ("killed", "survived", "timeout", "not compilable",
                                                                  "error")}
    judged = len(results) - counts["not compilable"]
    report = {
        "series": [p.name for p in series_module().read_series()],
        "added_code_lines": lines,
        "seconds": round(time.time() - started),
        "jobs": len(trees) if runnable else 0,
        "limit": args.limit,
        "rerun": str(args.rerun) if args.rerun else None,
        "files": args.files,
        "summary": {**counts, "total": len(results), "equivalent_skipped": len(skipped)},
        "failing_unmutated": failing,
        "mutants": results,
        "equivalent": [{"file": m.path, "line": m.line, "diff": f"-{m.original}\n+{m.mutated}",
                        "reason": equivalent[m.key].reason} for m in skipped],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    survivors = [r for r in results if r["status"] in ("survived", "timeout", "error")]
    for r in survivors:
        print(f"{r['status'].upper()}: {r['file']}:{r['line']} [{r['operator']}]\n  {r['diff'].replace(chr(10), chr(10) + '  ')}")
    print(f"mutants: {counts['killed']}/{judged} killed, {counts['survived']} survived, {counts['timeout']} timed out, "
          f"{counts['error']} errors, {counts['not compilable']} not compilable, {len(skipped)} equivalent skipped; "
          f"{report['seconds'] / 60:.1f} min; report {args.out}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
