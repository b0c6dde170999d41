"""Small SGLang trees for the series tooling's tests, and the oracle they are judged by.

A small tree holds what scripts/check's copy holds: the files the series touches plus
the package markers (sglang/__init__.py, _version.py), copied from the pristine tree
($PRISTINE_SGLANG, set by `make test`), in either layout. The oracle for "fully
patched" is git apply, run independently of the scripts under test; the decision is
always a sha256 listing of the whole tree, hidden files included.
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

ROOT = Path(__file__).resolve().parents[2]
PRISTINE = os.environ.get("PRISTINE_SGLANG")
sys.path.insert(0, str(ROOT / "scripts"))
import _series  # noqa: E402

LAYOUTS = ("checkout", "installed")
MARKERS = ("python/sglang/__init__.py", "python/sglang/_version.py")


def series_names() -> list[str]:
    return [p.name for p in _series.read_series()]


def run(script: str, *args, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *map(str, args)], capture_output=True,
                          text=True, env=None if env is None else {**os.environ, **env}, cwd=cwd)


def digest(tree: Path) -> dict[str, str]:
    """sha256 of every file under ``tree`` (hidden ones too), by relative path."""
    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tree.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def local(layout: str, upstream: str) -> str:
    return upstream if layout == "checkout" else upstream[len(_series.UPSTREAM_PREFIX):]


def small_tree(dest: Path, layout: str, patched: bool = False) -> Path:
    """The series' files and the package markers, pristine (or patched by git apply)."""
    for upstream in _series.Series.load().paths + list(MARKERS):
        target = dest / local(layout, upstream)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(PRISTINE) / upstream[len(_series.UPSTREAM_PREFIX):], target)
    if patched:
        git_apply(dest, layout)
    return dest


def git_apply(tree: Path, layout: str, names: list[str] | None = None, reverse: bool = False) -> None:
    """The oracle: git apply of the named patches (default all), outside any repository."""
    patches = [ROOT / "patches" / n for n in (names or series_names())]
    strip = "-p1" if layout == "checkout" else "-p2"
    with tempfile.TemporaryDirectory(prefix="oracle-git-") as git_dir:
        subprocess.run(["git", "init", "-q", "--bare", git_dir], check=True)
        env = dict(os.environ, GIT_DIR=git_dir, GIT_WORK_TREE=str(tree))
        subprocess.run(["git", "apply", strip, *(["-R"] if reverse else []),
                        *map(str, reversed(patches) if reverse else patches)],
                       cwd=tree, env=env, check=True, capture_output=True)


@pytest.fixture(scope="session")
def patched_listing(tmp_path_factory) -> dict[str, dict[str, str]]:
    """Per layout, the sha256 listing of a small tree with the whole series in (git apply)."""
    scratch = tmp_path_factory.mktemp("oracle")
    return {layout: digest(small_tree(scratch / layout, layout, patched=True)) for layout in LAYOUTS}


needs_pristine = pytest.mark.skipif(not PRISTINE, reason="set by `make test`: the pristine tree's python/ folder")
