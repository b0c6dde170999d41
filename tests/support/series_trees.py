"""SGLang trees for the series tooling's tests, and the oracle they are judged by.

Two kinds of series: the real one (patches/, over the pristine tree in $PRISTINE_SGLANG,
which `make test` sets), and a synthetic one (``Synthetic``: three patches over a small
fake SGLang 0.5.20, made with git format-patch as export-patches makes them, in a copy of
this repository's scripts), so that tests of states and faults depend on no patch of the
real series. A small tree holds the series' files and the package markers, in either
layout. The oracle for "patched" is git apply of the patch files, run apart from the
scripts; the decision is a sha256 listing of the whole tree, hidden files included.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from harness.project import series_module

ROOT = Path(__file__).resolve().parents[2]
PRISTINE = os.environ.get("PRISTINE_SGLANG")
_series = series_module()   # scripts/_series.py, loaded from its file

LAYOUTS = ("checkout", "installed")
RECORD = _series.RECORD
TRACER = ROOT / "tests" / "support" / "trace_run.py"
needs_pristine = pytest.mark.skipif(not PRISTINE, reason="set by `make test`: the pristine tree's python/ folder")


def digest(tree: Path, record: bool = True) -> dict[str, str]:
    """sha256 of every file under ``tree`` (hidden ones too; with ``record`` False, none of
    the scripts' own: the record and a change's staging), by relative path."""
    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tree.rglob("*")) if p.is_file() and "__pycache__" not in p.parts
            and (record or not any(part.startswith(RECORD) for part in p.parts))}


def package(tree: Path, layout: str) -> Path:
    return tree / ("python/sglang" if layout == "checkout" else "sglang")


def git_apply(tree: Path, layout: str, patches: list[Path], reverse: bool = False) -> None:
    """The oracle: git apply of whole patch files, outside any repository."""
    with tempfile.TemporaryDirectory(prefix="oracle-git-") as git_dir:
        subprocess.run(["git", "init", "-q", "--bare", git_dir], check=True)
        subprocess.run(["git", "apply", "-p1" if layout == "checkout" else "-p2", *(["-R"] if reverse else []),
                        *map(str, patches[::-1] if reverse else patches)], cwd=tree, check=True, capture_output=True,
                       env=dict(os.environ, GIT_DIR=git_dir, GIT_WORK_TREE=str(tree)))


class Series:
    """A repository root (scripts/, sglang.pin, patches/) and the pristine package its series is for."""

    def __init__(self, root: Path, pristine: Path):
        self.root, self.pristine = root, pristine

    @property
    def patches(self) -> list[Path]:
        return _series.read_series(self.root / "patches")

    @property
    def files(self) -> list[str]:
        """The files the series changes, relative to the sglang package."""
        return _series.Series(self.root / "patches").files

    def run(self, script: str, *args, env: dict | None = None,
            traced: dict | None = None) -> subprocess.CompletedProcess:
        """One of its scripts; ``traced``: under tests/support/trace_run.py with these TRACE_* settings."""
        command = [sys.executable, *([str(TRACER)] if traced else []), str(self.root / "scripts" / script)]
        return subprocess.run([*command, *map(str, args)], capture_output=True, text=True,
                              env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {}), **(traced or {})})

    def tree(self, dest: Path, layout: str = "installed", patched: bool = False) -> Path:
        """The series' files and the package markers, pristine (or patched by git apply)."""
        for rel in self.files + ["__init__.py", "_version.py"]:
            (package(dest, layout) / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.pristine / rel, package(dest, layout) / rel)
        if patched:
            git_apply(dest, layout, self.patches)
        return dest


REAL = Series(ROOT, Path(PRISTINE or "/nonexistent") / "sglang")

FAKE_FILES = {  # a fake SGLang 0.5.20: enough for find_target, the version and three patched files
    "__init__.py": "",
    "_version.py": "__version__ = version = '0.5.20'\n",
    "srt/__init__.py": "",
    "srt/pool.py": "\n\n".join(f"def f{i}():\n    return {i}\n" for i in range(12)),
    "srt/kernels/copy.cuh": "".join(f"// line {i}\nint k{i}(int x) {{ return x + {i}; }}\n" for i in range(12)),
    "srt/cache.py": "".join(f"CONSTANT_{i} = {i}\n" for i in range(20)),
}
FAKE_PATCHES = [  # (subject, {file: [(old, new)]})
    ("pool: return twice", {"srt/pool.py": [("return 1\n", "return 2 * 1\n")]}),
    ("kernels: add one more", {"srt/pool.py": [("return 9\n", "return 9 + 1\n")],
                               "srt/kernels/copy.cuh": [("x + 3;", "x + 3 + 1;")]}),
    ("cache: a larger constant", {"srt/pool.py": [("return 11\n", "return 11 * 2\n")],
                                  "srt/kernels/copy.cuh": [("x + 10;", "x + 20;")],
                                  "srt/cache.py": [("CONSTANT_4 = 4\n", "CONSTANT_4 = 40\n")]}),
]


def git(folder: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_AUTHOR_DATE="2026-01-01T00:00:00Z",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t", GIT_COMMITTER_DATE="2026-01-01T00:00:00Z")
    return subprocess.run(["git", "-C", str(folder), *args], check=True, capture_output=True, text=True, env=env).stdout


def relock(patches: Path) -> None:
    """patches/series.sha256 for the series as patches/series lists it, as export-patches writes it
    (a test that stands for a new series, not an edit of one, takes this step too)."""
    names = [n.strip() for n in (patches / "series").read_text().splitlines() if n.strip()]
    (patches / _series.SUMS_FILE).write_text(_series.sums_text(patches, names))


def synthetic(dest: Path, patches=FAKE_PATCHES) -> Series:
    """A copy of this repository's scripts whose patches/ is a synthetic series over a fake SGLang."""
    upstream, root = dest / "upstream", dest / "repo"
    for rel, text in FAKE_FILES.items():
        (upstream / "python/sglang" / rel).parent.mkdir(parents=True, exist_ok=True)
        (upstream / "python/sglang" / rel).write_text(text)
    git(upstream, "init", "-q")
    git(upstream, "add", "-A")
    git(upstream, "commit", "-qm", "SGLang 0.5.20 (fake)")
    git(upstream, "tag", "base")
    for subject, edits in patches:
        for rel, changes in edits.items():
            path = upstream / "python/sglang" / rel
            text = path.read_text()
            for old, new in changes:
                assert text.count(old) == 1, (rel, old)
                text = text.replace(old, new)
            path.write_text(text)
        git(upstream, "commit", "-qam", f"{subject}\n\nWhy: a test.")
    out = root / "patches"
    git(upstream, "format-patch", "-q", "--zero-commit", "--no-signature", "--no-stat", "--full-index",
        "--abbrev=40", "--no-numbered", "-o", str(out), "base..HEAD")
    (out / "series").write_text("".join(f"{p.name}\n" for p in sorted(out.glob("*.patch"))))
    relock(out)
    shutil.copytree(ROOT / "scripts", root / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "sglang.pin", root / "sglang.pin")
    git(upstream, "checkout", "-q", "base")
    return Series(root, upstream / "python/sglang")


@pytest.fixture
def fake(tmp_path) -> Series:
    return synthetic(tmp_path / "series")
