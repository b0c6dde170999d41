"""A mutation worker: one copy of the patched tree, SGLang imported once, a fork per mutant.

    python -m harness.mutants.worker TREE    (cwd: the project root; PYTHONPATH: TREE, then the root)

Importing SGLang takes longer than most mutants' tests, so the worker imports it once
and forks a child per run. The child writes nothing to the worker's stdout (its own
output goes to a log file), drops from ``sys.modules`` the mutated module and every
loaded module that imports it, directly or not (found once from their sources), so
that those re-import from the mutated file, and runs pytest in-process. The worker
restores the file afterwards, with its original timestamp, so no stale bytecode of a
mutant is ever used (children write no bytecode).

Protocol: one JSON object per line on stdin, one per line on stdout.
  {"tests": [...], "timeout": s, "log": path, "path": "sglang/...", "line": n, "mutated": "..."}
  (no "path": a baseline run of the unmutated tree)
  optional "deselect": [nodeid, ...]; a baseline run does not stop at the first failure
  -> {"status": "killed"|"survived"|"timeout"|"error", "seconds": t, "failed": [nodeid, ...],
      "modules": [...] (baseline only: what the run imported, for the next preload)}
"""
from __future__ import annotations

import ast
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def import_graph() -> dict[str, set[str]]:
    """module -> names it imports (absolute), for every loaded sglang module."""
    graph = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not name.startswith("sglang") or not file or not file.endswith(".py"):
            continue
        package = name if file.endswith("__init__.py") else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(Path(file).read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parent = ".".join(parts[: len(parts) - node.level + 1])
                    base = f"{parent}.{base}" if base else parent
                imported.add(base)
                imported.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = imported
    return graph


def module_name(path: str) -> str:
    return path[: -len(".py")].replace("/", ".").removesuffix(".__init__")


def evict(names):
    """Unload modules so that the next import runs their (mutated) source again.

    Dropping a module from sys.modules is not enough: its package keeps it as an
    attribute, and ``from package import module`` returns that attribute. And a
    package's submodules go with it: one left loaded makes Python skip re-importing the
    package it belongs to."""
    names = set(names)
    names |= {loaded for loaded in list(sys.modules) if any(loaded.startswith(f"{n}.") for n in names)}
    for name in names:
        sys.modules.pop(name, None)
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and child in vars(sys.modules[parent]):
            delattr(sys.modules[parent], child)


def dependents(graph: dict[str, set[str]], target: str) -> set[str]:
    closure, grew = {target}, True
    while grew:
        grew = False
        for name, imported in graph.items():
            if name not in closure and imported & closure:
                closure.add(name)
                grew = True
    return closure


class Failures:
    """pytest plugin: the node ids of the failing tests, in order."""

    def __init__(self):
        self.nodeids = []

    def pytest_runtest_logreport(self, report):
        if report.failed and report.nodeid not in self.nodeids:
            self.nodeids.append(report.nodeid)

    def pytest_collectreport(self, report):
        if report.failed:
            self.nodeids.append(f"collecting {report.nodeid}")


def run_child(job, tree: Path, graph, result_path: Path):
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.dont_write_bytecode = True
    if "path" in job:
        evict(dependents(graph, module_name(job["path"])))
    import pytest

    plugin = Failures()
    options = ["-q", "-p", "no:cacheprovider", "-p", "no:randomly"] + (["-x"] if "path" in job else [])
    deselect = [arg for nodeid in job.get("deselect", ()) for arg in ("--deselect", nodeid)]
    code = pytest.main([*options, *deselect, *job["tests"]], plugins=[plugin])
    result = {"code": int(code), "failed": plugin.nodeids}
    if "path" not in job:
        result["modules"] = sorted(sys.modules)
    result_path.write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


def run(job, tree: Path, graph) -> dict:
    target = tree / job["path"] if "path" in job else None
    original = target.read_bytes() if target else None
    stat = target.stat() if target else None
    if target:
        lines = original.decode().splitlines(keepends=True)
        ending = lines[job["line"] - 1][len(lines[job["line"] - 1].rstrip("\r\n")):]
        lines[job["line"] - 1] = job["mutated"] + ending
        target.write_text("".join(lines))
    result_path = Path(job["log"] + ".json")
    result_path.unlink(missing_ok=True)
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            run_child(job, tree, graph, result_path)
        finally:
            os._exit(3)
    status = None
    deadline = started + job["timeout"]
    while status is None:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            status = wait_status
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = "timeout"
        else:
            time.sleep(0.05)
    seconds = round(time.monotonic() - started, 2)
    if target:
        target.write_bytes(original)
        os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    if status == "timeout":
        return {"status": "timeout", "seconds": seconds, "failed": []}
    if not result_path.exists():  # the child died (a mutant can crash the interpreter)
        return {"status": "killed", "seconds": seconds, "failed": [f"child exited abnormally ({status})"]}
    result = json.loads(result_path.read_text())
    # 1: a test failed; 2: collection failed (the mutant broke an import). Both fail the tier.
    outcome = {0: "survived", 1: "killed", 2: "killed"}.get(result["code"], "error")
    reply = {"status": outcome, "seconds": seconds, "failed": result["failed"]}
    if "modules" in result:
        reply["modules"] = result["modules"]
    return reply


def preload(names):
    for name in names:
        if name.startswith(("tests.", "__main__")) or name == "tests":
            continue
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - optional modules the run happened to touch
            pass


def main():
    tree = Path(sys.argv[1]).resolve()
    os.chdir(ROOT)
    import torch

    torch.set_num_threads(1)  # no thread pool in the parent of forks
    graph = {}
    for raw in sys.stdin:
        job = json.loads(raw)
        if job.get("preload"):
            # Keep loaded only what no series file reaches: the modules that import a series
            # module (transitively) are imported by each child from its mutated tree, and
            # only as far as its tests need them.
            preload(job["preload"])
            graph = import_graph()
            loaded = len(sys.modules)
            for module in job["series"]:
                evict(dependents(graph, module))
            unloaded = loaded - len(sys.modules)
            graph = import_graph()
            # What is loaded now never changes: keep it out of the collector, so that the
            # children's collections (pytest runs several) neither walk nor copy it.
            gc.collect()
            gc.freeze()
            print(json.dumps({"status": "ready", "loaded": len(sys.modules), "unloaded": unloaded}), flush=True)
            continue
        print(json.dumps(run(job, tree, graph)), flush=True)


if __name__ == "__main__":
    main()
