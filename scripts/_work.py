"""The work folder where the series lives as commits (scripts/import-patches, export-patches)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import _series as s

# git am records a committer; format-patch never prints it, so any identity will do
# on a machine that has none configured.
FALLBACK_IDENTITY = {"GIT_COMMITTER_NAME": "series import", "GIT_COMMITTER_EMAIL": "series-import@localhost"}
NAME_LIMIT = 60
# Words a truncated name does not end on: "...-slots-by-a" reads worse than "...-slots".
DANGLING = {"a", "an", "and", "at", "by", "for", "from", "in", "of", "on", "or", "the", "to", "with"}


def folder(option: str | None) -> Path:
    """--work, else $SERIES_WORK, else build/work."""
    return Path(option or os.environ.get("SERIES_WORK") or s.ROOT / "build" / "work").resolve()


def git(work: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for key, value in FALLBACK_IDENTITY.items():
        env.setdefault(key, value)
    proc = subprocess.run(["git", "-C", str(work), *args], capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise s.SeriesError(f"git {' '.join(args)} in {work} failed:\n{proc.stderr.strip()}")
    return proc


def patch_name(number: int, subject: str) -> str:
    """NNNN-slug.patch: the subject's words (as git format-patch keeps them), joined by
    '-', cut at a word boundary to at most NAME_LIMIT characters."""
    words = [w for w in re.split(r"[^A-Za-z0-9_.]+", subject) if w.strip(".")]
    kept: list[str] = []
    for word in words:
        if len("-".join(kept + [word])) > NAME_LIMIT:
            while len(kept) > 1 and kept[-1].lower() in DANGLING:
                kept.pop()
            break
        kept.append(word)
    slug = "-".join(kept) or (words[0][:NAME_LIMIT] if words else "patch")
    return f"{number:04d}-{slug}.patch"
