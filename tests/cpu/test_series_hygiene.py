"""The series' hygiene, as scripts/check enforces it: names, headers, export round trip, format.

scripts/check runs on the real series in `make test`; these tests prove each check fails when it should.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.series_trees import ROOT, _series, digest, fake, needs_pristine, relock  # noqa: F401


def load_check():
    loader = importlib.machinery.SourceFileLoader("series_check", str(ROOT / "scripts" / "check"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("series_check", loader))
    loader.exec_module(module)
    return module


check = load_check()
TOOLS = Path(os.environ.get("SERIES_LINT_TOOLS") or Path(sys.executable).parent)


@pytest.mark.parametrize("subject, name", [
    ("hicache: a short subject", "0001-hicache-a-short-subject.patch"),
    ("mamba: let the state transfer kernels step device slots by a given stride",  # cut, not on "by"
     "0002-mamba-let-the-state-transfer-kernels-step-device-slots.patch"),
    ("hicache: split --hicache-size by the tokens each device pool serves",
     "0003-hicache-split-hicache-size-by-the-tokens-each-device-pool.patch"),
    ("a: v0.5.20's file.py, (and more)", "0004-a-v0.5.20-s-file.py-and-more.patch"),
])
def test_patch_names_are_whole_words_of_the_subject(subject, name):
    assert _series.patch_name(int(name[:4]), subject) == name
    assert len(name[5:-len(".patch")]) <= 60


FIXTURE = """From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: A Maintainer <a@example.org>
Date: Mon, 30 Nov 2026 10:46:10 +0000
Subject: [PATCH] hicache: a fixture

What the patch changes, and why.

Upstream-Status: Pending (to be sent to sgl-project/sglang)
Forwarded: no
Drop-When: upstream SGLang does the same.
Tests: tests/cpu/test_series_hygiene.py,
 tests/cpu/test_series_tooling.py

diff --git a/python/sglang/x.py b/python/sglang/x.py
index 0000000000000000000000000000000000000001..0000000000000000000000000000000000000002 100644
--- a/python/sglang/x.py
+++ b/python/sglang/x.py
@@ -1 +1 @@
-a
+b
"""

BROKEN = {
    "no From": (("From: A Maintainer <a@example.org>\n", ""), "no From: header"),
    "no description": (("What the patch changes, and why.\n\n", ""), "no description"),
    "no Upstream-Status": (("Upstream-Status: Pending (to be sent to sgl-project/sglang)\n", ""),
                           "lacks a 'Upstream-Status:' line"),
    "bad Upstream-Status": (("Upstream-Status: Pending", "Upstream-Status: Maybe"), "must start with one of"),
    "no Forwarded": (("Forwarded: no\n", ""), "lacks a 'Forwarded:' line"),
    "bad Forwarded": (("Forwarded: no", "Forwarded: soon"), "Forwarded: must be"),
    "no Drop-When": (("Drop-When: upstream SGLang does the same.\n", ""), "lacks a 'Drop-When:' line"),
    "no Tests": (("Tests: tests/cpu/test_series_hygiene.py,\n tests/cpu/test_series_tooling.py\n", ""),
                 "lacks a 'Tests:' line"),
    "missing test": (("tests/cpu/test_series_tooling.py", "tests/cpu/test_gone.py"),
                     "Tests: tests/cpu/test_gone.py does not exist"),
    "not a repository path": (("tests/cpu/test_series_tooling.py", "/abs/test_x.py"), "is not a test file path"),
}


@pytest.mark.parametrize("case", ["complete", *BROKEN])
def test_a_complete_header_passes_and_each_missing_header_is_named(tmp_path, case):
    (old, new), expected = BROKEN.get(case, (("", ""), None))
    patch = tmp_path / "0001-hicache-a-fixture.patch"
    assert old in FIXTURE
    patch.write_text(FIXTURE.replace(old, new, 1))
    problems = check.header_problems(patch)
    assert problems == [] if expected is None else len(problems) == 1 and expected in problems[0], problems


def test_the_real_series_passes_the_lint():
    assert check.lint_files(_series.read_series()) == []


def project_copy(dest: Path) -> Path:
    """What scripts/check needs of this project (the patches name test files)."""
    for item in ("scripts", "patches", "tests"):
        shutil.copytree(ROOT / item, dest / item, ignore=shutil.ignore_patterns("__pycache__"))
    for item in ("sglang.pin", "requirements/lint.txt"):
        (dest / item).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / item, dest / item)
    return dest


@needs_pristine
@pytest.mark.project_files  # the project's lint tools (requirements/lint.txt)
def test_the_export_round_trip_catches_a_patch_its_commit_would_not_give(tmp_path):
    """A hunk header's function context edited by hand: only a re-export from the commits shows it."""
    project = project_copy(tmp_path / "project")
    patch = project / "patches" / _series.read_series()[0].name
    patch.write_text(re.sub(r"^(@@ [^@]+ @@).*$", r"\1 edited by hand", patch.read_text(), count=1, flags=re.M))
    relock(project / "patches")  # its sums made again by hand too: only the round trip is left to see it
    proc = subprocess.run([sys.executable, str(project / "scripts" / "check"),
                           str(Path(os.environ["PRISTINE_SGLANG"]).parent), "--tools", str(TOOLS)],
                          capture_output=True, text=True)
    fails = [line for line in proc.stderr.splitlines() if line.startswith("FAIL ")]
    assert proc.returncode == 1
    assert fails == [f"FAIL export round trip: {patch.name} changes when re-exported:",
                     "FAIL export round trip: series.sha256 changes when re-exported:"], proc.stderr
    assert "edited by hand" in proc.stderr


@pytest.mark.project_files  # the project's lint tools (requirements/lint.txt)
def test_sglang_formatters_catch_a_badly_formatted_line(fake, tmp_path):
    tree = fake.tree(tmp_path / "tree", "checkout", patched=True)
    series = _series.Series(fake.root / "patches")
    target = _series.find_target(tree)
    assert check.check_format(target, series, TOOLS) == []
    python = next(rel for rel in series.files if rel.endswith(".py"))
    kernel = next(rel for rel in series.files if rel.endswith(".cuh"))
    for rel, line in ((python, b"x = [ 1,2 ]\n"), (kernel, b"int  x( int a ){return a;}\n")):
        (target.package_dir / rel).write_bytes((target.package_dir / rel).read_bytes() + line)
    problems = check.check_format(target, series, TOOLS)
    assert len(problems) == 2, problems
    assert "ruff format would change" in problems[0] and python in problems[0]
    assert f"clang-format would change python/sglang/{kernel}" in problems[1]


@needs_pristine
def test_the_layout_check_catches_a_byte_apply_and_reverse_did_not_restore(tmp_path, monkeypatch):
    """check's copies are in the layout asked for; its judge names a byte apply + reverse did not restore."""
    # PRISTINE_SGLANG holds sglang/, under `make test` as in the image (install-into-python sets it)
    series, pristine = _series.Series(), _series.find_target(os.environ["PRISTINE_SGLANG"])
    for layout in ("installed", "checkout"):
        target = check.copy_tree(pristine, tmp_path / layout, layout, series)
        assert target.layout == layout and check.check_layout(target, layout) == []
    run_script = _series.run_script

    def reverse_leaves_a_byte(verb, *args, **kwargs):
        proc = run_script(verb, *args, **kwargs)
        if verb == "reverse":
            with (target.package_dir / series.files[0]).open("ab") as changed:
                changed.write(b"\n")
        return proc
    monkeypatch.setattr(check.s, "run_script", reverse_leaves_a_byte)
    assert check.check_layout(target, "checkout layout") == [
        "checkout layout: apply + reverse did not restore every byte"]


def test_what_git_apply_writes_is_checked_against_the_index_lines(fake, tmp_path):
    """A series whose last index line is wrong is refused before anything is written."""
    last = fake.patches[-1]
    text = last.read_text()
    new = re.findall(r"^index [0-9a-f]+\.\.([0-9a-f]{40})", text, re.M)[-1]
    last.write_text(text.replace(f"..{new}", f"..{'0' * 40}"))
    relock(fake.root / "patches")
    tree = fake.tree(tmp_path / "tree")
    before = digest(tree)
    proc = fake.run("apply", tree)
    assert proc.returncode == 1 and "other bytes than the index lines name" in proc.stderr and digest(tree) == before


def test_the_series_digest_is_what_sha256sum_says_of_the_series(fake):
    """The sha256 of `sha256sum series PATCH...` in patches/, so that anyone can recompute it."""
    names = (fake.root / "patches" / "series").read_text().split()
    listing = subprocess.run(["sha256sum", "series", *names], cwd=fake.root / "patches", capture_output=True,
                             check=True).stdout
    assert _series.Series(fake.root / "patches").digest == hashlib.sha256(listing).hexdigest()
