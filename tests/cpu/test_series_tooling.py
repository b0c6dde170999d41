"""scripts/apply, reverse and status: every state the series can leave a tree in, bad input.

Each case runs the real scripts on a small tree (the series' files plus the package
markers, from the pristine tree in $PRISTINE_SGLANG) in both layouts and decides by the
sha256 listing of the whole tree against an oracle (git apply of the series). Fault
injection (failed writes, kills, signals) is in test_series_faults.py.
"""
from __future__ import annotations

import fcntl
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.series_trees import (LAYOUTS, ROOT, _series, digest, git_apply, local,  # noqa: F401
                                        needs_pristine, patched_listing, run, series_names, small_tree)

pytestmark = needs_pristine
MAMBA = "python/sglang/srt/mem_cache/pool_host/mamba.py"


@pytest.fixture(params=LAYOUTS)
def layout(request):
    return request.param


@pytest.fixture
def tree(tmp_path, layout):
    return small_tree(tmp_path / "tree", layout)


def test_apply_then_reverse_restores_every_byte(tree, layout, patched_listing):
    before = digest(tree)
    applied = run("apply", tree)
    assert applied.returncode == 0, applied.stderr
    assert digest(tree) == patched_listing[layout]  # the same bytes as git apply
    again = run("apply", tree)
    assert again.returncode == 0 and "already applied" in again.stdout
    status = run("status", tree)
    assert status.returncode == 0 and status.stdout.splitlines()[0].endswith("series applied")
    assert all(f"[x] {name}: applied" in status.stdout for name in series_names())
    reversed_ = run("reverse", tree)
    assert reversed_.returncode == 0, reversed_.stderr
    assert digest(tree) == before
    assert run("reverse", tree).stdout.startswith("series is not applied")
    assert run("status", tree).stdout.splitlines()[0].endswith("series pristine")


def test_wrong_version_is_refused(tree):
    version_file = next(tree.rglob("sglang/_version.py"))
    version_file.write_text(version_file.read_text().replace("'0.5.20'", "'0.5.19'"))
    before = digest(tree)
    proc = run("apply", tree)
    assert proc.returncode == 1 and "expected 0.5.20, found 0.5.19" in proc.stderr
    assert digest(tree) == before


def test_patches_applied_by_hand_are_recognised_completed_and_reversed(tree, layout, patched_listing, tmp_path):
    pristine = digest(tree)
    first = series_names()[:3]
    for name in first:  # as a user would: GNU patch, one patch at a time
        subprocess.run(["patch", "-s", "-p1" if layout == "checkout" else "-p2", "-i", str(ROOT / "patches" / name)],
                       cwd=tree, check=True)
    status = run("status", tree)
    assert status.returncode == 3 and status.stdout.splitlines()[0].endswith("series partial")
    for number, name in enumerate(series_names()):
        assert (f"[x] {name}: applied" if number < 3 else f"[ ] {name}: not applied") in status.stdout
    completed = shutil.copytree(tree, tmp_path / "completed")
    applied = run("apply", completed)
    assert applied.returncode == 0 and f"already in before: {', '.join(first)}" in applied.stdout
    assert digest(completed) == patched_listing[layout]
    reversed_ = run("reverse", tree)
    assert reversed_.returncode == 0 and reversed_.stdout.startswith("reversed 3 patches in ")
    assert digest(tree) == pristine


def test_any_subset_of_hunks_is_read_exactly():
    """Whatever hunks a file holds (a tool stopped part-way, `patch` with rejects), the
    hunk reader names exactly those and gives back SGLang's file: 40 random subsets a file."""
    import _hunks

    series, rng, checked = _series.Series.load(), random.Random(16), 0
    for path in series.paths:
        pristine = (Path(os.environ["PRISTINE_SGLANG"]) / path[len("python/"):]).read_bytes()
        hunks = series.hunks(path)
        for _ in range(40):
            flags = [rng.random() < 0.5 for _ in hunks]
            data, failed = _hunks.apply_hunks(pristine, [h for h, f in zip(hunks, flags) if f])
            if data is None:  # a later hunk that needs an earlier one: not a state anything produces
                continue
            state = _hunks.analyse(path, data, hunks, series.pristine_blob(path))
            assert (state.applied, state.pristine, state.conflict, state.local_edits) == (flags, pristine, None, False)
            checked += 1
    assert checked > 200


def test_a_partly_applied_patch_is_named_then_reversed_or_completed(tree, layout, patched_listing, tmp_path):
    import _hunks

    pristine = digest(tree)
    series = _series.Series.load()
    mamba = tree / local(layout, MAMBA)
    hunks = series.hunks(MAMBA)
    data, failed = _hunks.apply_hunks(mamba.read_bytes(), hunks[::2])  # every other hunk of 0005
    assert failed is None
    mamba.write_bytes(data)
    status = run("status", tree)
    patch = next(n for n in series_names() if n.startswith("0005-"))
    assert f"[~] {patch}: partly applied ({len(hunks[::2])} of {len(hunks)} hunks in)" in status.stdout
    completed = shutil.copytree(tree, tmp_path / "completed")
    assert run("apply", completed).returncode == 0 and digest(completed) == patched_listing[layout]
    assert run("reverse", tree).returncode == 0 and digest(tree) == pristine


def test_a_tree_an_interrupted_tool_left_is_named_and_repaired(tree, layout, tmp_path):
    """git apply, killed while writing, leaves some files patched, some not, one deleted."""
    pristine = digest(tree)
    git_apply(tree, layout)
    paths = _series.Series.load().paths
    for path in paths[5:]:
        shutil.copy2(Path(os.environ["PRISTINE_SGLANG"]) / path[len("python/"):], tree / local(layout, path))
    common = tree / local(layout, "python/sglang/srt/mem_cache/pool_host/common.py")
    saved = common.read_bytes()
    common.unlink()
    before = digest(tree)
    status = run("status", tree)
    assert "series conflicting" in status.stdout.splitlines()[0]
    assert f"missing: {local(layout, 'python/sglang/srt/mem_cache/pool_host/common.py')}" in status.stdout
    for verb in ("apply", "reverse"):
        proc = run(verb, tree)
        assert proc.returncode == 1 and "missing" in proc.stderr and "nothing changed" in proc.stderr
        assert "pip install --force-reinstall --no-deps sglang==0.5.20" in proc.stderr
        assert digest(tree) == before
    common.write_bytes(saved)  # restored as the message says (the patched copy will do)
    assert run("status", tree).stdout.splitlines()[0].endswith("series partial")
    assert run("reverse", tree).returncode == 0 and digest(tree) == pristine


def test_files_a_patch_tool_left_are_named(tree, layout):
    mamba = tree / local(layout, MAMBA)
    mamba.with_name("mamba.py.rej").write_text("@@ rejected hunk @@\n")
    status = run("status", tree)
    assert f"foreign: {local(layout, MAMBA)}.rej" in status.stdout


def test_local_edits_are_refused_unless_forced(tree, layout):
    mamba = tree / local(layout, MAMBA)
    mamba.write_bytes(mamba.read_bytes() + b"\n# a local edit\n")
    before = digest(tree)
    proc = run("apply", tree)
    assert proc.returncode == 1 and "local edits" in proc.stderr and "nothing changed" in proc.stderr
    assert f"\n  {local(layout, MAMBA)}\n" in proc.stderr + "\n"  # the path in full, as the user knows it
    assert digest(tree) == before
    forced = run("apply", "--force", tree)
    assert forced.returncode == 0, forced.stderr
    assert mamba.read_bytes().endswith(b"\n# a local edit\n")
    assert "local edits (outside the series' hunks)" in run("status", tree).stdout
    assert run("reverse", tree).returncode == 1
    assert run("reverse", "--force", tree).returncode == 0 and digest(tree) == before


def test_a_checkout_names_its_files_from_its_root(tmp_path):
    """The path a user sees starts with python/ (it once lost its first letter)."""
    tree = small_tree(tmp_path / "checkout", "checkout")
    mamba = tree / MAMBA
    mamba.write_bytes(mamba.read_bytes() + b"# edit\n")
    proc = run("apply", tree)
    assert f"\n  {MAMBA}" in proc.stderr and "ython/sglang" not in proc.stderr.replace("python/sglang", "")


def test_a_file_that_holds_something_else_is_conflicting(tree, layout):
    mamba = tree / local(layout, MAMBA)
    text = mamba.read_bytes()
    hunk = _series.Series.load().hunks(MAMBA)[0]
    line = next(l for l in hunk.old if l.strip() and text.count(l) == 1)  # a line only that hunk's text holds
    mamba.write_bytes(text.replace(line, line.rstrip(b"\n") + b"  # changed\n"))
    before = digest(tree)
    status = run("status", tree)
    assert status.stdout.splitlines()[0].endswith("series conflicting")
    assert re.search(r"\[!\] 0005-\S+: conflicting \(" + re.escape(local(layout, MAMBA)), status.stdout)
    for verb in ("apply", "reverse"):
        proc = run(verb, tree)
        assert proc.returncode == 1 and "nothing changed" in proc.stderr and "neither applied nor applicable" in proc.stderr
        assert digest(tree) == before


@pytest.mark.parametrize("bad", ["missing", "not-sglang"])
def test_bad_paths_get_a_clear_error(tmp_path, bad):
    path = tmp_path / "nope" if bad == "missing" else tmp_path
    proc = run("apply", path)
    assert proc.returncode == 1 and proc.stderr.startswith("error: ")
    assert {"missing": "no such directory", "not-sglang": "not an SGLang tree"}[bad] in proc.stderr


def test_the_package_folder_itself_is_a_target(tree, layout):
    package = next(tree.rglob("sglang/__init__.py")).parent
    proc = run("apply", package)
    assert proc.returncode == 0, proc.stderr
    assert run("status", tree).stdout.splitlines()[0].endswith("series applied")


def test_a_folder_holding_both_layouts_is_refused_and_the_package_named_instead(tmp_path):
    both = small_tree(tmp_path / "both", "checkout")
    small_tree(both, "installed")
    before = digest(both)
    proc = run("apply", both)
    assert proc.returncode == 1
    assert f"{both / 'python' / 'sglang'} (an upstream checkout)" in proc.stderr
    assert f"{both / 'sglang'} (an installed package)" in proc.stderr and "name the package folder" in proc.stderr
    assert digest(both) == before
    assert run("apply", both / "sglang").returncode == 0
    assert run("status", both / "sglang").returncode == 0 and run("status", both / "python" / "sglang").returncode == 3


def dist_info(tree: Path, version: str, owns: bool = True) -> Path:
    info = tree / f"sglang-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: sglang\nVersion: {version}\n\n")
    (info / "RECORD").write_text("sglang/__init__.py,,\n" if owns else "other/__init__.py,,\n")
    return info


def test_a_stale_dist_info_does_not_confuse_the_tools(tmp_path, patched_listing):
    tree = small_tree(tmp_path / "site", "installed")
    dist_info(tree, "0.5.19")  # left over by an interrupted upgrade: sorts first
    dist_info(tree, "0.5.20")
    proc = run("apply", tree)
    assert proc.returncode == 0, proc.stderr
    assert run("status", tree).stdout.splitlines()[0] == f"SGLang 0.5.20 at {tree / 'sglang'} (installed layout): series applied"
    (tree / "sglang" / "_version.py").unlink()  # then only the dist-info folders tell the version
    proc = run("status", tree)
    assert proc.returncode == 1 and "2 dist-info folders that each claim sglang/" in proc.stderr
    assert "sglang-0.5.19.dist-info, sglang-0.5.20.dist-info" in proc.stderr
    (tree / "sglang-0.5.19.dist-info" / "RECORD").write_text("other/__init__.py,,\n")
    assert run("status", tree).stdout.startswith("SGLang 0.5.20 at")


def test_one_verb_at_a_time(tree):
    package = next(tree.rglob("sglang/__init__.py")).parent
    fd = os.open(package, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        proc = run("apply", tree)
    finally:
        os.close(fd)
    assert proc.returncode == 1 and "another apply, reverse or status is working on" in proc.stderr


def test_an_unreadable_journal_is_left_alone(tree):
    package = next(tree.rglob("sglang/__init__.py")).parent
    (package / ".sglang-series-journal").write_text("not json")
    before = digest(tree)
    proc = run("apply", tree)
    assert proc.returncode == 1 and "is unreadable" in proc.stderr
    assert digest(tree) == before


@pytest.mark.project_files  # the Makefile is not in the image
def test_make_quotes_sglang_dir(tmp_path, patched_listing):
    tree = small_tree(tmp_path / "a b", "installed")
    count = len(series_names())
    for target, expected in (("apply-patches", f"applied {count} patches"), ("status", "series applied"),
                             ("unapply-patches", f"reversed {count} patches")):
        proc = subprocess.run(["make", "-s", "-C", str(ROOT), target, f"SGLANG_DIR={tree}"], capture_output=True,
                              text=True)
        assert proc.returncode == 0 and expected in proc.stdout, proc.stderr
        if target == "apply-patches":
            assert digest(tree) == patched_listing["installed"]


@pytest.mark.project_files  # the Makefile is not in the image
def test_make_shows_import_errors():
    """`make` proves the patched tree imports; a traceback must reach the user."""
    makefile = (ROOT / "Makefile").read_text()
    assert "import-check" in makefile.split("\npatched:", 1)[1].split("\n\n", 1)[0]
    recipe = makefile.split("\nimport-check:", 1)[1].split("\n\n", 1)[0]
    assert "import sglang" in recipe and "2>/dev/null" not in recipe and "2>&-" not in recipe


def diff(*hunks: str) -> str:
    return "diff --git a/python/sglang/x.py b/python/sglang/x.py\n--- a/python/sglang/x.py\n" \
           "+++ b/python/sglang/x.py\n" + "".join(hunks)


LINES = "".join(f"line {i}\n" for i in range(1, 31))
PLACEMENTS = {  # (file, patch): where git apply puts a hunk, or refuses it
    "at line 1, exact": (LINES, diff("@@ -1,2 +1,2 @@\n-line 1\n+LINE 1\n line 2\n")),
    "at line 1, file grew on top": ("new\n" + LINES, diff("@@ -1,2 +1,2 @@\n-line 1\n+LINE 1\n line 2\n")),
    "at the end, file grew below": (LINES + "new\n", diff("@@ -29,2 +29,2 @@\n line 29\n-line 30\n+LINE 30\n")),
    "offset by inserted lines": ("a\nb\n" + LINES, diff("@@ -9,3 +9,3 @@\n line 9\n-line 10\n+LINE 10\n line 11\n")),
    "nearest of two matches, below": (LINES.replace("line 24\nline 25\nline 26\n", "line 4\nline 5\nline 6\n"),
                                      diff("@@ -24,3 +24,3 @@\n line 4\n-line 5\n+LINE 5\n line 6\n")),
    "nearest of two matches, above": (LINES.replace("line 24\nline 25\nline 26\n", "line 4\nline 5\nline 6\n"),
                                      diff("@@ -7,3 +7,3 @@\n line 4\n-line 5\n+LINE 5\n line 6\n")),
    "no newline at the end": (LINES + "last", diff("@@ -30,2 +30,2 @@\n line 30\n-last\n\\ No newline at end of file\n"
                                                   "+LAST\n\\ No newline at end of file\n")),
    "crlf lines": (LINES.replace("\n", "\r\n"), diff("@@ -3,3 +3,3 @@\n line 3\r\n-line 4\r\n+LINE 4\r\n line 5\r\n")),
}


@pytest.mark.parametrize("case", PLACEMENTS)
def test_hunks_are_placed_where_git_apply_places_them(tmp_path, case):
    import _hunks

    text, patch_text = PLACEMENTS[case]
    (tmp_path / "sglang").mkdir()
    target = tmp_path / "sglang" / "x.py"
    target.write_bytes(text.encode())
    patch = tmp_path / "0001-x.patch"
    patch.write_bytes(patch_text.encode())
    git = subprocess.run(["git", "apply", "-p2", str(patch)], cwd=tmp_path, capture_output=True,
                         env={**os.environ, "GIT_DIR": str(tmp_path / "none"), "GIT_CEILING_DIRECTORIES": str(tmp_path)})
    ours, failed = _hunks.apply_hunks(text.encode(), _hunks.parse_patch(patch).hunks)
    assert (ours is None) == (git.returncode != 0), git.stderr
    if ours is not None:
        assert ours == target.read_bytes()


def test_a_hunk_found_in_the_wrong_place_is_a_conflict(tmp_path):
    """The user's own copy of a hunk's new text, above the real place, must not pass for
    the hunk: undoing it there and redoing it gives another file, which is refused."""
    import _hunks

    block = "def f():\n    return 1\n\n"
    pristine = "# a\n" + block + "".join(f"# filler {i}\n" for i in range(8)) + block
    patch = tmp_path / "0001-x.patch"
    patch.write_text(diff("@@ -12,3 +12,3 @@\n def f():\n-    return 1\n+    return 2\n \n"))
    hunks = _hunks.parse_patch(patch).hunks
    edited = pristine.replace("return 1", "return 2", 1)  # only the first, wrong copy
    state = _hunks.analyse("python/sglang/x.py", edited.encode(), hunks, None)
    assert state.conflict and not state.consistent


def test_bytecode_of_changed_files_cannot_outlive_them(tree, layout):
    """A tree compiled with unchecked-hash .pyc files (Python never compares them with the
    source): after apply and after reverse, Python loads each changed module's new code."""
    import importlib.machinery
    import importlib.util

    def loaded(path: Path):
        name = path.stem
        return importlib.machinery.SourceFileLoader(name, str(path)).get_code(name)

    subprocess.run([sys.executable, "-m", "compileall", "-q", "--invalidation-mode", "unchecked-hash", str(tree)],
                   check=True)
    modules = [tree / local(layout, p) for p in _series.Series.load().paths if p.endswith(".py")]
    assert all(Path(importlib.util.cache_from_source(str(m))).exists() for m in modules)
    untouched = next(tree.rglob("sglang/_version.py"))
    kept = Path(importlib.util.cache_from_source(str(untouched)))
    for verb in ("apply", "reverse"):
        assert run(verb, tree).returncode == 0
        for module in modules:
            assert loaded(module) == compile(module.read_bytes(), str(module), "exec"), (verb, module)
    assert kept.exists()  # the bytecode of files the series does not change stays


def test_patch_leftovers_are_named_by_apply_and_reverse_and_kept(tree, layout):
    rej = (tree / local(layout, MAMBA)).with_name("mamba.py.rej")
    orig = (tree / local(layout, MAMBA)).with_name("mamba.py.orig")
    rej.write_text("@@ rejected @@\n")
    orig.write_text("original\n")
    for verb in ("apply", "reverse"):
        proc = run(verb, tree)
        assert proc.returncode == 0, proc.stderr
        assert f"{local(layout, MAMBA)}.orig, {local(layout, MAMBA)}.rej" in proc.stderr
        assert "note: left by a patch tool" in proc.stderr
    assert rej.read_text() == "@@ rejected @@\n" and orig.read_text() == "original\n"


def test_a_symlinked_file_is_refused_and_named(tree, layout, tmp_path):
    mamba = tree / local(layout, MAMBA)
    real = tmp_path / "elsewhere" / "mamba.py"
    real.parent.mkdir()
    shutil.copy2(mamba, real)
    mamba.unlink()
    mamba.symlink_to(real)
    before = digest(tree), real.read_bytes()
    proc = run("apply", tree)
    assert proc.returncode == 1 and "nothing changed" in proc.stderr
    assert f"{local(layout, MAMBA)} -> {real}" in proc.stderr and "symbolic links" in proc.stderr
    assert (digest(tree), real.read_bytes()) == before and mamba.is_symlink()
    assert f"symbolic link: {local(layout, MAMBA)} -> {real}" in run("status", tree).stdout


def repo_copy(tmp_path: Path) -> Path:
    """This repository's scripts and patches in a scratch folder (they find sglang.pin and
    patches/ beside themselves)."""
    root = tmp_path / "repo"
    for part in ("scripts", "patches"):
        shutil.copytree(ROOT / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "sglang.pin", root / "sglang.pin")
    return root


def test_a_series_with_a_patch_missing_or_moved_is_refused(tree, tmp_path):
    root = repo_copy(tmp_path)
    names = series_names()
    before = digest(tree)
    # 0009 and 0010 both change kernels/ops/kvcache/hicache.py: dropping 0009 breaks the
    # chain of blob ids (0010 expects the file as 0009 leaves it), and so does swapping them.
    for edited in ([n for n in names if not n.startswith("0009-")], names[:8] + [names[9], names[8]]):
        (root / "patches" / "series").write_text("\n".join(edited) + "\n")
        for verb in ("apply", "status"):
            proc = subprocess.run([sys.executable, str(root / "scripts" / verb), str(tree)], capture_output=True,
                                  text=True)
            assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
            assert "a patch is missing, added or out of order" in proc.stderr and "Traceback" not in proc.stderr
    assert digest(tree) == before


@pytest.mark.parametrize("pin", ["missing", "SGLANG_VERSION = 0.5.20\n", 'SGLANG_VERSION="0.5.20"\n',
                                 "SGLANG_COMMIT=abc\n"])
def test_a_missing_or_malformed_pin_is_one_line(tmp_path, pin):
    root = repo_copy(tmp_path)
    if pin == "missing":
        (root / "sglang.pin").unlink()
    else:
        (root / "sglang.pin").write_text(pin)
    for script, *args in (("status", tmp_path), ("apply", tmp_path), ("install-into-python", "--python", "python3"),
                          ("build-pristine",), ("fetch-wheel",)):
        proc = subprocess.run([str(root / "scripts" / script), *map(str, args)], capture_output=True, text=True)
        assert proc.returncode == 1 and proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1, \
            (script, proc.stderr)
        assert "sglang.pin" in proc.stderr and not (root / "build").exists()


@pytest.mark.parametrize("verb", ["apply", "reverse", "status"])
def test_ctrl_c_before_anything_is_written_is_one_line_and_130(tree, verb):
    if verb == "reverse":
        assert run("apply", tree).returncode == 0
    before = digest(tree)
    proc = run(verb, tree, env={"SGLANG_SERIES_FAULT": "opened:SIGINT"})
    assert proc.returncode == 130 and proc.stderr == (
        "error: interrupted (Ctrl-C) before anything was written; nothing changed\n")
    assert digest(tree) == before
