"""scripts/apply and scripts/reverse under faults: every file changed, or none.

Each case runs the real scripts on a small tree (the series' files plus the package
markers) in both layouts and decides by the sha256 listing of the whole tree: after a
failed write it is what it was; after a kill, once the next verb has recovered it, it is
either what it was or exactly the fully patched (or pristine) tree, depending on whether
the kill came before or after the swap was complete. Faults: a folder that refuses new
files and an immutable file (chattr +i as root, chmod otherwise), and through
scripts/_journal.py's test hook an OSError (a full disk, an I/O error) or a SIGKILL,
SIGINT or SIGTERM at every step of the write, steps read from a traced real run.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.series_trees import (LAYOUTS, _series, digest, needs_pristine, patched_listing,  # noqa: F401
                                        run, small_tree)

pytestmark = needs_pristine
VERBS = ("apply", "reverse")
# OSError codes a write can meet, by step: the first one a step can raise is used.
ERRNO = {"journal": "ENOSPC", "write": "ENOSPC", "link": "EPERM", "swap": "EIO"}


@pytest.fixture(params=LAYOUTS)
def layout(request):
    return request.param


def start_tree(tmp_path: Path, layout: str, verb: str) -> Path:
    """What the verb starts from: pristine for apply, patched for reverse."""
    return small_tree(tmp_path / "start", layout, patched=verb == "reverse")


def steps_of(tree: Path, verb: str, scratch: Path) -> list[str]:
    """Every step a real run of the verb passes, as scripts/_journal.py names them."""
    copy = shutil.copytree(tree, scratch / "traced")
    trace = scratch / "trace"
    assert run(verb, copy, env={"SGLANG_SERIES_TRACE": str(trace)}).returncode == 0
    # "opened" comes before the transaction (a Ctrl-C there: test_series_tooling.py)
    steps = [step for step in trace.read_text().split() if step != "opened"]
    assert steps[0] == "journal:prepare" and steps[-1] == "finished" and "swap:10" in steps
    return steps


def run_each(start: Path, verb: str, faults: list[str], scratch: Path) -> list[tuple[Path, subprocess.CompletedProcess]]:
    """Run the verb once per fault, each on its own copy of ``start``, as many at once as
    there are cores; returns (copy, result) in order."""
    def one(numbered):
        number, fault = numbered
        tree = shutil.copytree(start, scratch / f"run-{number}")
        return tree, run(verb, tree, env={"SGLANG_SERIES_FAULT": fault})

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return list(pool.map(one, enumerate(faults)))


def recover(tree: Path) -> None:
    """What every verb does first (scripts/_series.opened): finish an interrupted change."""
    with _series.opened(tree):
        pass


@pytest.mark.parametrize("verb", VERBS)
def test_sigkill_at_every_step_leaves_the_tree_whole(tmp_path, layout, verb, patched_listing):
    start = start_tree(tmp_path, layout, verb)
    before = digest(start)
    after = patched_listing[layout] if verb == "apply" else digest(small_tree(tmp_path / "pristine", layout))
    steps = steps_of(start, verb, tmp_path)
    swapped = steps.index("journal:done")  # the "done" journal is written after this step
    for number, (step, (tree, proc)) in enumerate(zip(steps, run_each(start, verb, steps, tmp_path))):
        assert proc.returncode == -9, (step, proc.stdout, proc.stderr)
        recover(tree)
        assert digest(tree) == (before if number <= swapped else after), step


@pytest.mark.parametrize("next_verb", ["status", "apply", "reverse"])
def test_the_next_verb_recovers_a_killed_apply(tmp_path, layout, next_verb, patched_listing):
    tree = start_tree(tmp_path, layout, "apply")
    before = digest(tree)
    assert run("apply", tree, env={"SGLANG_SERIES_FAULT": "swap:5"}).returncode == -9
    assert digest(tree) != before  # half swapped, with the journal and side files beside it
    proc = run(next_verb, tree)
    assert "rolled back an interrupted apply: 4 of 10 files put back" in proc.stderr
    expected = {"status": before, "reverse": before, "apply": patched_listing[layout]}[next_verb]
    assert digest(tree) == expected, proc.stderr


@pytest.mark.parametrize("layout, verb", [("checkout", "apply"), ("installed", "reverse")])
def test_an_oserror_at_any_step_changes_nothing_or_finishes(tmp_path, layout, verb, patched_listing):
    start = start_tree(tmp_path, layout, verb)
    before = digest(start)
    after = patched_listing[layout] if verb == "apply" else digest(small_tree(tmp_path / "pristine", layout))
    steps = steps_of(start, verb, tmp_path)[:-1]
    swapped = steps.index("journal:done")
    faults = [f"{step}:{ERRNO.get(step.split(':')[0], 'EIO')}" for step in steps]
    for number, (step, (tree, proc)) in enumerate(zip(steps, run_each(start, verb, faults, tmp_path))):
        if number <= swapped:
            assert proc.returncode == 1 and "nothing changed" in proc.stderr and f"injected at {step}" in proc.stderr
            assert digest(tree) == before, step
        else:  # only clean-up was left: the change stands, the next run removes what is left over
            assert proc.returncode == 0 and "removing its side files failed" in proc.stderr, proc.stderr
            recover(tree)
            assert digest(tree) == after, step


@pytest.mark.parametrize("layout, signame", [("checkout", "SIGINT"), ("installed", "SIGTERM")])
def test_a_signal_cancels_before_the_swap_and_waits_for_it_after(tmp_path, layout, signame, patched_listing):
    start = start_tree(tmp_path, layout, "apply")
    before = digest(start)
    steps = steps_of(start, "apply", tmp_path)
    code = 128 + {"SIGINT": 2, "SIGTERM": 15}[signame]
    faults = [f"{step}:{signame}" for step in steps]
    for number, (step, (tree, proc)) in enumerate(zip(steps, run_each(start, "apply", faults, tmp_path))):
        assert proc.returncode == code, (step, proc.stderr)
        if number <= steps.index("journal:swap"):
            assert "cancelled before any file changed" in proc.stderr and digest(tree) == before, step
        else:
            assert "finished first" in proc.stderr and digest(tree) == patched_listing[layout], step


@contextlib.contextmanager
def unwritable(path: Path):
    """Make ``path`` refuse changes: immutable as root (chattr +i), read-only otherwise.
    Yields False when this filesystem cannot (the caller then uses the test hook)."""
    if os.geteuid() == 0:
        try:
            done = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
        except OSError:  # no chattr here (e2fsprogs not installed)
            done = False
        try:
            yield done
        finally:
            if done:
                subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield True
        finally:
            path.chmod(mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="chattr is tried only as root")
def test_unwritable_without_chattr_falls_back_to_the_hook(tmp_path, monkeypatch):
    """Found by the image's build: as root where e2fsprogs is not installed, chattr is
    missing; unwritable() must say it cannot (the caller then uses the test hook), not raise."""
    (tmp_path / "no-commands").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "no-commands"))
    with unwritable(tmp_path) as done:
        assert done is False


@pytest.mark.parametrize("verb", VERBS)
@pytest.mark.parametrize("what", ["folder", "file"])
def test_an_unwritable_folder_or_file_changes_nothing(tmp_path, layout, verb, what):
    tree = start_tree(tmp_path, layout, verb)
    before = digest(tree)
    pool_host = next(tree.rglob("sglang/srt/mem_cache/pool_host"))
    victim = pool_host if what == "folder" else pool_host / "mamba.py"
    if what == "file" and os.geteuid() != 0:
        victim = pool_host  # a read-only file in a writable folder is replaced as git would: use the folder
    with unwritable(victim) as refused:
        fault = {} if refused else {"SGLANG_SERIES_FAULT": "write:5:EACCES"}
        proc = run(verb, tree, env=fault)
        assert digest(tree) == before
    assert proc.returncode == 1 and "nothing changed" in proc.stderr, proc.stderr
    assert "Operation not permitted" in proc.stderr or "Permission denied" in proc.stderr
    assert run(verb, tree).returncode == 0  # and once writable, the same verb goes through


def test_modes_are_kept(tmp_path, layout):
    tree = start_tree(tmp_path, layout, "apply")
    files = [tree / f for f in digest(tree) if f.endswith((".py", ".cuh")) and not f.endswith("__init__.py")]
    for number, path in enumerate(files):
        path.chmod((0o640, 0o755, 0o600)[number % 3])
    modes = {p: p.stat().st_mode for p in files}
    for verb in VERBS:
        assert run(verb, tree).returncode == 0
        assert {p: p.stat().st_mode for p in files} == modes, verb


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv (util-linux)")
def test_a_user_who_cannot_finish_a_killed_swap_is_told_who_can():
    """A root apply killed during the swap; another user's status names the cause
    (permission denied) and who can finish it; root's status then does."""
    shared = Path(tempfile.mkdtemp(prefix="series-other-user-"))  # pytest's own folders are root's alone
    shared.chmod(0o755)
    try:
        check_other_user(shared)
    finally:
        shutil.rmtree(shared)


def check_other_user(tmp_path: Path) -> None:
    tree = start_tree(tmp_path, "installed", "apply")
    before = digest(tree)
    assert run("apply", tree, env={"SGLANG_SERIES_FAULT": "swap:5"}).returncode == -9
    nobody = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                             str(_series.ROOT / "scripts" / "status"), str(tree)], capture_output=True, text=True)
    assert nobody.returncode == 1 and len(nobody.stderr.splitlines()) == 1, nobody.stderr
    assert "permission denied" in nobody.stderr and "as root" in nobody.stderr
    assert "not written by these scripts" not in nobody.stderr
    root = run("status", tree)
    assert root.returncode == 3 and "rolled back an interrupted apply" in root.stderr
    assert digest(tree) == before


@pytest.mark.parametrize("damage", ["old copies gone", "file changed since"])
def test_a_swap_that_cannot_be_undone_still_leaves_a_usable_tree(tmp_path, patched_listing, damage):
    """A reverse killed mid-swap, then its side copies removed by hand (or a swapped file
    edited): the next verb undoes what it can, names what it leaves, removes the journal,
    and the tree is usable: apply or reverse then complete it (or refuse an edit, naming it)."""
    tree = start_tree(tmp_path, "installed", "reverse")
    pristine = digest(small_tree(tmp_path / "pristine", "installed"))
    assert run("reverse", tree, env={"SGLANG_SERIES_FAULT": "swap:5"}).returncode == -9
    olds = sorted(tree.rglob(".*.sglang-series-old"))
    swapped = [p.with_name(p.name[1:-len(".sglang-series-old")]) for p in olds][:4]
    if damage == "old copies gone":
        for old in olds:
            old.unlink()
    else:
        swapped[0].write_bytes(swapped[0].read_bytes() + b"# edited\n")
    proc = run("status", tree)
    assert proc.returncode == 3, proc.stderr
    assert not list(tree.rglob(".sglang-series-journal*"))
    if damage == "old copies gone":
        assert proc.stderr.count("keeps the new bytes (its old copy is gone)") == 4
        assert run("reverse", tree).returncode == 0 and digest(tree) == pristine
        return
    kept = swapped[0].with_name(f".{swapped[0].name}.sglang-series-old")
    assert f"{swapped[0]} changed since (its bytes before the change are in {kept})" in proc.stderr
    assert kept.exists() and f"foreign: {kept.relative_to(tree)}" in proc.stdout
    refused = run("apply", tree)
    assert refused.returncode == 1 and "local edits" in refused.stderr and "nothing changed" in refused.stderr
