"""Shared logic of the patch-series scripts: the series, the target tree, and git apply.

The series lives in ``patches/series`` (one ``NNNN-subject.patch`` per line, in order).
Patches carry upstream paths (``a/python/sglang/...``). A target is either

* an upstream checkout: a folder holding ``python/sglang/`` (applied with ``-p1``), or
* an installed SGLang: a folder holding ``sglang/`` directly, such as site-packages or
  ``/sgl-workspace/sglang/python`` (applied with ``-p2``).

Every change goes through one ``git apply`` invocation over the whole series, which is
atomic: either every hunk applies exactly (git apply never fuzzes) or nothing is written.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "patches"
SERIES_FILE = PATCH_DIR / "series"
EXPECTED_VERSION = "0.5.20"
UPSTREAM_COMMIT = "94602c9c2b7cbdb8efd5c52802dac6a1c180089e"
UPSTREAM_PREFIX = "python/"


class SeriesError(Exception):
    """A condition the user must fix; the message says what and how."""


def read_series() -> list[Path]:
    if not SERIES_FILE.is_file():
        raise SeriesError(f"{SERIES_FILE} is missing")
    names = [
        line.strip()
        for line in SERIES_FILE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return [PATCH_DIR / name for name in names]


def touched_files(patch: Path) -> list[str]:
    """Upstream paths (``python/sglang/...``) that a patch modifies."""
    paths = []
    for line in patch.read_text().splitlines():
        match = re.match(r"^diff --git a/(\S+) b/(\S+)$", line)
        if match:
            paths.append(match.group(2))
    return paths


@dataclass(frozen=True)
class Target:
    """Where SGLang's sources live and how patch paths map onto them."""

    root: Path  # the folder git apply runs in
    strip: int  # -p value for git apply
    layout: str  # "checkout" or "installed"

    @property
    def package_dir(self) -> Path:
        if self.layout == "checkout":
            return self.root / "python" / "sglang"
        return self.root / "sglang"

    def local_path(self, upstream_path: str) -> Path:
        if self.layout == "checkout":
            return self.root / upstream_path
        return self.root / upstream_path[len(UPSTREAM_PREFIX):]


def find_target(path: str | os.PathLike) -> Target:
    root = Path(path).resolve()
    if not root.is_dir():
        raise SeriesError(f"{path}: no such directory")
    if (root / "python" / "sglang" / "__init__.py").is_file():
        return Target(root, 1, "checkout")
    if (root / "sglang" / "__init__.py").is_file():
        return Target(root, 2, "installed")
    if root.name == "sglang" and (root / "srt").is_dir():
        raise SeriesError(
            f"{path} is the sglang package itself; pass the folder that holds it: {root.parent}"
        )
    raise SeriesError(
        f"{path} is not an SGLang tree: expected python/sglang/ (an upstream checkout) "
        "or sglang/ (an installed SGLang, e.g. site-packages) inside it"
    )


def _read_version_file(package_dir: Path) -> str | None:
    version_file = package_dir / "_version.py"
    if not version_file.is_file():
        return None
    match = re.search(r"^__version__\s*=.*?['\"]([^'\"]+)['\"]", version_file.read_text(), re.M)
    return match.group(1) if match else None


def _read_dist_info_version(root: Path) -> str | None:
    for metadata in sorted(root.glob("sglang-*.dist-info/METADATA")):
        for line in metadata.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def _git(root: Path, *args: str) -> str | None:
    proc = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True
    )
    return proc.stdout.strip() if proc.returncode == 0 else None


def detect_version(target: Target) -> str:
    """The SGLang version of a tree, from the package's own metadata.

    In order: the generated ``sglang/_version.py`` (wheels, installs, built checkouts),
    the ``dist-info`` beside an installed package, then for a bare upstream checkout its
    git commit (the pinned v0.5.20 commit counts as 0.5.20).
    """
    version = _read_version_file(target.package_dir)
    if version is None and target.layout == "installed":
        version = _read_dist_info_version(target.root)
    if version is None and target.layout == "checkout":
        head = _git(target.root, "rev-parse", "HEAD")
        if head == UPSTREAM_COMMIT:
            version = EXPECTED_VERSION
        elif head:
            described = _git(target.root, "describe", "--tags", "--always", "HEAD")
            version = f"unknown (commit {described or head})"
    if version is None:
        raise SeriesError(
            f"cannot tell the SGLang version of {target.package_dir}: no _version.py, "
            "no dist-info and no git commit"
        )
    return version


def check_version(target: Target) -> str:
    version = detect_version(target)
    base = version.split("+", 1)[0]
    if base != EXPECTED_VERSION:
        raise SeriesError(
            f"wrong SGLang version in {target.package_dir}: expected {EXPECTED_VERSION}, found {version}"
        )
    return version


def _record_hashes(target: Target) -> dict[str, str] | None:
    """sha256 of every file an installed wheel recorded, keyed by upstream path."""
    records = sorted(target.root.glob("sglang-*.dist-info/RECORD"))
    if target.layout != "installed" or not records:
        return None
    hashes = {}
    with records[0].open(newline="") as handle:
        for row in csv.reader(handle):
            if len(row) >= 2 and row[1].startswith("sha256="):
                hashes[UPSTREAM_PREFIX + row[0]] = row[1][len("sha256="):]
    return hashes


def _sha256_b64(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def modified_files(target: Target, patches: list[Path]) -> list[str] | None:
    """Files the series touches that differ from what the target was installed with.

    Returns None when the target keeps no record to compare with (not a git checkout
    and no wheel RECORD): the atomic apply still refuses any context mismatch.
    """
    upstream_paths = sorted({p for patch in patches for p in touched_files(patch)})
    hashes = _record_hashes(target)
    if hashes is not None:
        return [
            p
            for p in upstream_paths
            if p in hashes
            and target.local_path(p).is_file()
            and _sha256_b64(target.local_path(p)) != hashes[p]
        ]
    top = _git(target.root, "rev-parse", "--show-toplevel")
    if top is None:
        return None
    local = [str(target.local_path(p)) for p in upstream_paths]
    status = _git(target.root, "status", "--porcelain", "--untracked-files=no", "--", *local)
    return [line[3:] for line in (status or "").splitlines()]


def git_apply(target: Target, patches: list[Path], *, reverse=False, check=False):
    """Run one git apply over ``patches`` in ``target``; returns the CompletedProcess.

    A throwaway GIT_DIR keeps git from discovering an enclosing repository (an
    installed tree inside an editable checkout, say), so paths are always relative to
    ``target.root``. git's own ``--check`` does not carry a file's state from one patch
    to the next, so a series with two patches to one file would never check; a check
    applies for real to a scratch copy of the touched files instead.
    """
    if check:
        with tempfile.TemporaryDirectory(prefix="series-check-") as scratch:
            for upstream_path in {p for patch in patches for p in touched_files(patch)}:
                source = target.local_path(upstream_path)
                if source.exists():
                    copy = Path(scratch) / source.relative_to(target.root)
                    copy.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(source, copy)
            return git_apply(replace(target, root=Path(scratch)), patches, reverse=reverse)
    with tempfile.TemporaryDirectory(prefix="series-git-") as git_dir:
        subprocess.run(["git", "init", "-q", "--bare", git_dir], check=True)
        env = dict(os.environ, GIT_DIR=git_dir, GIT_WORK_TREE=str(target.root))
        cmd = ["git", "apply", f"-p{target.strip}", "--whitespace=nowarn"]
        if reverse:
            cmd.append("--reverse")
        ordered = list(reversed(patches)) if reverse else list(patches)
        cmd += [str(p) for p in ordered]
        return subprocess.run(cmd, cwd=target.root, env=env, capture_output=True, text=True)


def series_state(target: Target, patches: list[Path]) -> str:
    """'applied', 'pristine' (the whole series applies), or 'partial'."""
    if not patches:
        return "applied"
    if git_apply(target, patches, reverse=True, check=True).returncode == 0:
        return "applied"
    if git_apply(target, patches, check=True).returncode == 0:
        return "pristine"
    return "partial"


def first_failing_patch(target: Target, patches: list[Path]) -> tuple[Path, str]:
    """The first patch that does not apply on top of the ones before it."""
    for count in range(1, len(patches) + 1):
        proc = git_apply(target, patches[:count], check=True)
        if proc.returncode != 0:
            return patches[count - 1], proc.stderr.strip()
    raise AssertionError("every patch applies")


def applied_prefix(target: Target, patches: list[Path]) -> int:
    """How many leading patches of the series are already in the tree."""
    count = 0
    for size in range(1, len(patches) + 1):
        if git_apply(target, patches[:size], reverse=True, check=True).returncode == 0:
            count = size
        else:
            break
    return count


def fail(message: str, code: int = 1):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)
