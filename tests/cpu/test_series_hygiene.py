"""The series' hygiene, as scripts/check enforces it: names, headers, export round trip, format.

scripts/check runs on the real series in `make test` before pytest; these tests prove
each of its checks fails when it should: header lint on fixture patches, the export
round trip on a copy of this project whose patch no longer matches its commit, and
SGLang's formatters on a patched tree with a badly formatted line.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.series_trees import ROOT, _series, git_apply, needs_pristine

sys.path.insert(0, str(ROOT / "scripts"))
from _work import patch_name  # noqa: E402


def load_check():
    loader = importlib.machinery.SourceFileLoader("series_check", str(ROOT / "scripts" / "check"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("series_check", loader))
    loader.exec_module(module)
    return module


check = load_check()
TOOLS = Path(os.environ.get("SERIES_LINT_TOOLS") or Path(sys.executable).parent)

SUBJECTS = {
    "hicache: let the staged write-back read a strided source":
        "0001-hicache-let-the-staged-write-back-read-a-strided-source.patch",
    "mamba: let the state transfer kernels step device slots by a given stride":
        "0002-mamba-let-the-state-transfer-kernels-step-device-slots.patch",
    "hicache: copy Mamba state from per-layer, strided device views":
        "0005-hicache-copy-Mamba-state-from-per-layer-strided-device-views.patch",
    "hicache: split --hicache-size by the tokens each device pool serves":
        "0006-hicache-split-hicache-size-by-the-tokens-each-device-pool.patch",
    "mamba: keep more host reads in flight when loading state to the device":
        "0007-mamba-keep-more-host-reads-in-flight-when-loading-state.patch",
}


@pytest.mark.parametrize("subject", SUBJECTS)
def test_patch_names_are_whole_words(subject):
    number = int(SUBJECTS[subject][:4])
    name = patch_name(number, subject)
    assert name == SUBJECTS[subject]
    slug = name[5:-len(".patch")]
    assert len(slug) <= 60
    words = re.split(r"[^A-Za-z0-9_.]+", subject)
    assert slug.split("-") == [w for w in words if w][: len(slug.split("-"))]  # a run of whole words


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


def test_a_complete_header_passes(tmp_path):
    patch = tmp_path / "0001-hicache-a-fixture.patch"
    patch.write_text(FIXTURE)
    assert check.header_problems(patch) == []


@pytest.mark.parametrize("case", BROKEN)
def test_each_missing_header_is_named(tmp_path, case):
    (old, new), expected = BROKEN[case]
    patch = tmp_path / "0001-hicache-a-fixture.patch"
    assert old in FIXTURE
    patch.write_text(FIXTURE.replace(old, new, 1))
    problems = check.header_problems(patch)
    assert len(problems) == 1 and expected in problems[0], problems


def test_the_real_series_passes_the_lint():
    assert check.lint_files(_series.read_series()) == []


def project_copy(dest: Path) -> Path:
    """What scripts/check needs of this project: its scripts, the series, the pin, the
    lint requirements, and the test files the patches name."""
    for item in ("scripts", "patches", "tests"):
        shutil.copytree(ROOT / item, dest / item, ignore=shutil.ignore_patterns("__pycache__"))
    for item in ("sglang.pin", "requirements/lint.txt"):
        (dest / item).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / item, dest / item)
    return dest


@needs_pristine
@pytest.mark.project_files  # the project's git history and lint tools (requirements/lint.txt)
def test_the_export_round_trip_catches_a_patch_its_commit_would_not_give(tmp_path):
    """A hunk header's function context is git's to write: edited by hand, only a
    re-export from the commits shows it."""
    project = project_copy(tmp_path / "project")
    patch = project / "patches" / _series.read_series()[0].name
    text = patch.read_text()
    header = re.search(r"^@@ -\d+,\d+ \+\d+,\d+ @@(.*)$", text, re.M)
    patch.write_text(text.replace(header.group(0), header.group(0).replace(header.group(1), " edited by hand"), 1))
    proc = subprocess.run([sys.executable, str(project / "scripts" / "check"),
                           str(Path(os.environ["PRISTINE_SGLANG"]).parent), "--tools", str(TOOLS)],
                          capture_output=True, text=True)
    fails = [line for line in proc.stderr.splitlines() if line.startswith("FAIL ")]
    assert proc.returncode == 1
    assert fails == [f"FAIL export round trip: {patch.name} changes when re-exported:"], proc.stderr
    assert "edited by hand" in proc.stderr


@needs_pristine
@pytest.mark.project_files  # the project's lint tools (requirements/lint.txt)
def test_sglang_formatters_catch_a_badly_formatted_line(tmp_path):
    series = _series.Series.load()
    pristine = _series.find_target(Path(os.environ["PRISTINE_SGLANG"]).parent)
    tree = check.copy_tree(pristine, tmp_path / "tree", "checkout", series.paths).root  # with SGLang's .clang-format
    git_apply(tree, "checkout")
    assert check.check_format(_series.find_target(tree), series, TOOLS) == []  # as the series is
    python = next(p for p in series.paths if p.endswith(".py"))
    kernel = next(p for p in series.paths if p.endswith(".cuh"))
    for path, line in ((python, b"x = [ 1,2 ]\n"), (kernel, b"int  x( int a ){return a;}\n")):
        (tree / path).write_bytes((tree / path).read_bytes() + line)
    problems = check.check_format(_series.find_target(tree), series, TOOLS)
    assert len(problems) == 2, problems
    assert "ruff format would change" in problems[0] and python[len("python/"):] in problems[0]
    assert f"clang-format would change {kernel}" in problems[1]


@needs_pristine
def test_blob_ids_that_do_not_match_the_files_are_caught(tmp_path):
    """The index lines are how the scripts know SGLang's own file (local edits): wrong ones must fail."""
    series = _series.Series.load()
    pristine = {p: (Path(os.environ["PRISTINE_SGLANG"]) / p[len("python/"):]).read_bytes() for p in series.paths}
    assert check.check_blob_ids(series, pristine, "real") == []
    source = _series.read_series()[2]
    text = source.read_text()
    old_blob = re.search(r"^index ([0-9a-f]{40})\.\.", text, re.M).group(1)
    (tmp_path / source.name).write_text(text.replace(old_blob, "0" * 40, 1))
    patches = [tmp_path / source.name if p == source else p for p in _series.read_series()]
    problems = check.check_blob_ids(_series.Series(patches), pristine, "edited")
    assert len(problems) == 1 and f"{source.name}: " in problems[0] and f"is not blob {'0' * 40}" in problems[0]
