"""scripts/apply and scripts/reverse under faults: every file changed, or none.

tests/support/trace_run.py stops the scripts at a write in the tree: SIGKILL, SIGINT, SIGTERM, or the
operation failing (ENOSPC, EIO). A full disk is a file-size limit (EFBIG part-way), a read-only tree
an immutable one (chattr +i as root) or one without write permission. Once the next verb has run, the
tree's sha256 listing is the tree as it was, or exactly what a clean run leaves, record included.
"""
from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.series_trees import REAL, TRACER, _series, digest, fake, needs_pristine, package  # noqa: F401

VERBS = {"apply": "installed", "reverse": "checkout"}  # each verb in one layout (the layout is not the swap's)


def start(series, tmp_path: Path, verb: str, layout: str) -> tuple[Path, dict, dict]:
    """The tree a verb starts from (pristine, or applied for reverse); the listings before and after a clean run."""
    tree = series.tree(tmp_path / "start", layout)
    if verb == "reverse":
        assert series.run("apply", tree).returncode == 0
    clean = shutil.copytree(tree, tmp_path / "clean")
    assert series.run(verb, clean).returncode == 0
    return tree, digest(tree), digest(clean)


def steps(series, tree: Path, verb: str, scratch: Path) -> list[str]:
    """Every write a clean run of the verb makes in the tree, as the tracer numbers them."""
    copy, log = shutil.copytree(tree, scratch / "traced"), scratch / "trace.log"
    assert series.run(verb, copy, traced={"TRACE_TREE": str(copy), "TRACE_LOG": str(log)}).returncode == 0
    return log.read_text().splitlines()


def commit_step(trace: list[str]) -> int:
    """The step that commits the change (.swap renamed to .done)."""
    return next(n for n, step in enumerate(trace, 1) if ".swap " in step and ".done" in step)


def mid_swap(trace: list[str]) -> int:
    """The step after the first file is swapped in."""
    return next(n for n, step in enumerate(trace, 1) if ".swap/new" in step) + 1


def killed_at(series, tree: Path, at: int) -> None:
    assert series.run("apply", tree, traced={"TRACE_TREE": str(tree), "TRACE_AT": str(at)}).returncode == -signal.SIGKILL


def phases(trace: list[str]) -> list[int]:
    """One step of each kind and phase (staging, into .swap, mid-swap, the commit, finishing)."""
    firsts = {}
    for number, step in enumerate(trace, 1):
        kind = step.split()[1], ".tmp" in step, ".swap/new" in step, ".done" in step
        firsts.setdefault(kind, number)
    return sorted(set(firsts.values()) | {len(trace)})


def run_each(series, start: Path, verb: str, faults: list[dict], scratch: Path) -> list[tuple[Path, object]]:
    """The verb once per fault, each on its own copy of ``start``, as many at once as there are cores."""
    def one(numbered):
        number, fault = numbered
        tree = shutil.copytree(start, scratch / f"run-{number}")
        return tree, series.run(verb, tree, traced={"TRACE_TREE": str(tree), **fault})
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return list(pool.map(one, enumerate(faults)))


@pytest.mark.parametrize("verb", VERBS)
def test_sigkill_at_every_write_leaves_the_tree_as_it_was_or_done(fake, tmp_path, verb):
    tree, before, after = start(fake, tmp_path, verb, VERBS[verb])
    trace = steps(fake, tree, verb, tmp_path)
    outcomes, halfway = [], 0
    for step, (copy, proc) in zip(trace, run_each(fake, tree, verb, [{"TRACE_AT": str(n)} for n in
                                                                   range(1, len(trace) + 1)], tmp_path)):
        assert proc.returncode == -signal.SIGKILL, (step, proc.stderr)
        halfway += digest(copy, record=False) not in (digest(tree, record=False), digest(tmp_path / "clean", False))
        _series.recover(package(copy, VERBS[verb]))  # what every verb does first
        outcomes.append(digest(copy))
        assert outcomes[-1] in (before, after), step
    commit = commit_step(trace)
    assert outcomes == [before] * commit + [after] * (len(trace) - commit)
    assert halfway == len(fake.files) - 1  # killed between two files' renames: the files were half swapped


def test_a_kill_mid_swap_is_rolled_back_by_whichever_verb_comes_next(fake, tmp_path):
    tree, before, after = start(fake, tmp_path, "apply", "installed")
    trace = steps(fake, tree, "apply", tmp_path)
    for verb, expected in (("status", before), ("reverse", before), ("apply", after)):
        copy = shutil.copytree(tree, tmp_path / verb)
        killed_at(fake, copy, mid_swap(trace))
        assert digest(copy) not in (before, after)
        proc = fake.run(verb, copy)
        assert "rolled back an interrupted apply: every file is as it was" in proc.stderr, proc.stderr
        assert digest(copy) == expected, verb


@pytest.mark.parametrize("verb, layout, faults", [("apply", "installed", ("ENOSPC", "EIO")),
                                                ("reverse", "checkout", ("ENOSPC", "EIO")),
                                                ("apply", "checkout", ("SIGINT",)), ("apply", "checkout", ("SIGTERM",))],
                         ids=["apply-errors", "reverse-errors", "apply-SIGINT", "apply-SIGTERM"])
def test_an_error_or_a_signal_at_any_write_changes_nothing_or_lets_the_change_stand(fake, tmp_path, verb, layout, faults):
    """ENOSPC (a full disk) or EIO, Ctrl-C or SIGTERM at a write of each phase: before the commit, one line
    says nothing changed and nothing did; after it, the change stands (an error: the next verb tidies up;
    a signal: the finishing waits for it)."""
    tree, before, after = start(fake, tmp_path, verb, layout)
    trace = steps(fake, tree, verb, tmp_path)
    at, commit = phases(trace), commit_step(trace)
    runs = run_each(fake, tree, verb, [{"TRACE_AT": str(n), "TRACE_DO": faults[n % len(faults)]} for n in at], tmp_path)
    for number, (copy, proc) in zip(at, runs):
        step, fault = trace[number - 1], faults[number % len(faults)]
        signalled = fault.startswith("SIG")
        if number <= commit:
            assert proc.returncode == (128 + getattr(signal, fault) if signalled else 1), (step, proc.stderr)
            assert len(proc.stderr.splitlines()) == 1 and "nothing changed" in proc.stderr, (step, proc.stderr)
            assert signalled or "injected at step" in proc.stderr, step
            assert digest(copy) == before, step
        else:
            assert proc.returncode == 0 and (signalled or "went through" in proc.stderr), (step, proc.stderr)
            if not signalled:
                _series.recover(package(copy, layout))
            assert digest(copy) == after, step


# Runs PROGRAM ARG... and sends itself SIGINT at the AT-th of: an import (Python loading the scripts),
# a close of a folder's descriptor (rmtree's, the fsyncs', the lock's), a call of _series.recover (a
# rollback starting); AT 0: none, the count written to $CALLS at exit.
AT_CALL = """
import atexit, os, runpy, signal, sys
what, at, calls = sys.argv[1], int(sys.argv[2]), []
atexit.register(lambda: at or open(os.environ["CALLS"], "w").write(str(calls.count(1))))
def count(*_):
    calls.append(1)
    if calls.count(1) == at:
        os.kill(os.getpid(), signal.SIGINT)
def wrap(owner, name, counts):
    real = getattr(owner, name)
    setattr(owner, name, lambda *args: (counts(*args) and count(), real(*args))[1])
if what == "import":  # from the script's first line (its exec) on
    sys.addaudithook(lambda event, args: event == "exec" and getattr(args[0], "co_filename", "") == sys.argv[0]
                     and calls.append(0) or event == "import" and 0 in calls and count())
elif what == "close":
    wrap(os, "close", lambda fd: os.path.isdir(f"/proc/self/fd/{fd}"))
else:
    import importlib.util  # the scripts' own _series, loaded from its file as they import it
    spec = importlib.util.spec_from_file_location("_series", os.path.join(sys.argv[3], "_series.py"))
    _series = sys.modules["_series"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(_series)
    wrap(_series, "recover", lambda pkg: True)
sys.argv = sys.argv[4:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def signalled(series, what: str, at: int, tree: Path, traced: dict | None = None) -> subprocess.CompletedProcess:
    program = [str(TRACER)] if traced else []
    return subprocess.run([sys.executable, "-c", AT_CALL, what, str(at), str(series.root / "scripts"), *program,
                           str(series.root / "scripts" / "apply"), str(tree)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "CALLS": str(tree) + ".calls",
                               **(traced or {})})


def calls(series, what: str, tree: Path, scratch: Path) -> int:
    copy = shutil.copytree(tree, scratch / "counted")
    assert signalled(series, what, 0, copy).returncode == 0
    return int(Path(str(copy) + ".calls").read_text())


def says_what_it_did(proc, tree: Path, before: dict, after: dict) -> None:
    """At most one line, never a traceback: nothing changed (exit 130), or the change went through."""
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) <= 1, proc.stderr
    if proc.returncode == 0 or "went through" in proc.stderr:
        _series.recover(package(tree, "installed"))
        assert digest(tree) == after, proc.stderr
    else:
        assert proc.returncode == 130 and "nothing changed" in proc.stderr, proc.stderr
        assert digest(tree) == before, proc.stderr


@pytest.mark.parametrize("what", ["import", "close"])
def test_ctrl_c_while_loading_or_as_the_lock_is_released_says_what_happened(fake, tmp_path, what):
    """Ctrl-C at every ninth import while Python loads the scripts (no handler set yet), and at each
    close of a folder's descriptor, the lock's last of all (after the commit)."""
    tree, before, after = start(fake, tmp_path, "apply", "installed")
    count = calls(fake, what, tree, tmp_path)
    for at in range(1, count + 1, 9 if what == "import" else 1):
        copy = shutil.copytree(tree, tmp_path / f"{what}-{at}")
        says_what_it_did(signalled(fake, what, at, copy), copy, before, after)


def test_a_second_ctrl_c_as_the_rollback_starts_does_not_stop_it(fake, tmp_path):
    """Ctrl-C mid-swap, then another as the rollback starts: the rollback finishes in the same run."""
    tree, before, after = start(fake, tmp_path, "apply", "installed")
    mid = mid_swap(steps(fake, tree, "apply", tmp_path))
    proc = signalled(fake, "recover", 2, tree, traced={"TRACE_TREE": str(tree), "TRACE_AT": str(mid), "TRACE_DO": "SIGINT"})
    says_what_it_did(proc, tree, before, after)
    assert proc.returncode == 130


@pytest.mark.parametrize("error", ["EROFS", "EACCES"])
def test_a_change_cut_short_in_a_tree_that_became_read_only_is_named(fake, tmp_path, error):
    """A kill mid-swap, then a read-only mount (EROFS) or no permission: status says it cannot finish, in one line."""
    tree, before, _ = start(fake, tmp_path, "apply", "installed")
    killed_at(fake, tree, mid_swap(steps(fake, tree, "apply", tmp_path)))
    held = digest(tree)
    proc = fake.run("status", tree, traced={"TRACE_TREE": str(tree), "TRACE_AT": "1", "TRACE_DO": error})
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "finishing it needs write access" in proc.stderr and digest(tree) == held, proc.stderr
    assert fake.run("status", tree).returncode == 3 and digest(tree) == before


@needs_pristine
@pytest.mark.parametrize("verb", ["apply", "reverse"])
def test_a_full_disk_fails_a_write_part_way_and_changes_nothing(tmp_path, verb):
    """The real series' files, a file-size limit below the largest: its copy fails part-way (EFBIG)."""
    tree, before, _ = start(REAL, tmp_path, verb, "installed")
    sizes = sorted(p.stat().st_size for p in package(tree, "installed").rglob("*") if p.is_file())
    limit = sizes[-1] - 100

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    proc = subprocess.run([sys.executable, str(REAL.root / "scripts" / verb), str(tree)], capture_output=True,
                          text=True, preexec_fn=limited)
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "File too large" in proc.stderr and "nothing changed" in proc.stderr, proc.stderr
    assert digest(tree) == before
    assert REAL.run(verb, tree).returncode == 0  # with room again, the same verb goes through


@contextlib.contextmanager
def read_only(tree: Path):
    """Every folder immutable (chattr +i, as root) or not writable; False where neither can be had."""
    folders = [tree, *[p for p in tree.rglob("*") if p.is_dir()]]
    if os.geteuid() == 0:
        done = shutil.which("chattr") and subprocess.run(["chattr", "+i", *map(str, folders)],
                                                         capture_output=True).returncode == 0
        try:
            yield bool(done)
        finally:
            if done:
                subprocess.run(["chattr", "-i", *map(str, folders)], check=True)
        return
    for folder in folders:
        folder.chmod(0o555)
    try:
        yield True
    finally:
        for folder in folders:
            folder.chmod(0o755)


@pytest.mark.parametrize("verb", ["apply", "reverse"])
def test_a_read_only_tree_is_read_and_refused_whole(fake, tmp_path, verb):
    tree, before, _ = start(fake, tmp_path, verb, "installed")
    with read_only(tree) as refusing:
        if not refusing:
            pytest.skip("root on a filesystem without chattr: no tree is read-only to this user")
        status = fake.run("status", tree)
        proc = fake.run(verb, tree)
        assert digest(tree) == before
    assert status.returncode == (3 if verb == "apply" else 0), status.stderr
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1 and "nothing changed" in proc.stderr
    assert "Operation not permitted" in proc.stderr or "Permission denied" in proc.stderr, proc.stderr
    assert fake.run(verb, tree).returncode == 0  # and once writable, the same verb goes through


def test_two_applies_at_once_one_wins_one_refuses(fake, tmp_path):
    """One apply held mid-swap: an apply, a status and a reverse meanwhile refuse and change nothing."""
    tree, before, after = start(fake, tmp_path, "apply", "installed")
    mid, gate = mid_swap(steps(fake, tree, "apply", tmp_path)), tmp_path / "go"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "TRACE_TREE": str(tree), "TRACE_AT": str(mid),
           "TRACE_DO": f"WAIT:{gate}"}
    holder = subprocess.Popen([sys.executable, str(TRACER), str(fake.root / "scripts" / "apply"), str(tree)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while not gate.with_name("go.waiting").exists():
            assert time.time() < deadline and holder.poll() is None, holder.communicate()
            time.sleep(0.05)
        held = digest(tree)
        assert held not in (before, after)  # mid-swap
        for verb in ("apply", "status", "reverse"):
            other = fake.run(verb, tree)
            assert other.returncode == 1 and len(other.stderr.splitlines()) == 1, other.stderr
            assert "another apply, reverse or status is working on" in other.stderr, verb
        assert digest(tree) == held
    finally:
        gate.touch()
        _, err = holder.communicate(timeout=60)
    assert holder.returncode == 0, err
    assert digest(tree) == after


def test_a_file_changed_after_a_kill_is_kept_and_named(fake, tmp_path):
    """A kill mid-swap, then a swapped file edited: the others are rolled back, the edit kept and its
    bytes before the apply beside it."""
    tree, before, _ = start(fake, tmp_path, "apply", "installed")
    trace = steps(fake, tree, "apply", tmp_path)
    killed_at(fake, tree, mid_swap(trace))
    edited = Path(next(step for step in trace if ".swap/new" in step).split()[-1].replace(str(tmp_path / "traced"),
                                                                                       str(tree)))
    edited.write_text(edited.read_text() + "# edited after the kill\n")
    proc = fake.run("status", tree)
    assert f"{edited} changed since; its bytes before the apply are in {edited}.sglang-series-old" in proc.stderr
    kept = edited.with_name(edited.name + ".sglang-series-old")
    assert digest(tree)[str(kept.relative_to(tree))] == before[str(edited.relative_to(tree))]
    assert f"foreign: {kept.relative_to(tree)}" in proc.stdout
    assert "conflicting" in proc.stdout.splitlines()[0] or "local edits" in proc.stdout
