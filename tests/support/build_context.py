"""The build context an engine sends for a Dockerfile, and what its COPY/ADD lines take from
it, by Docker's own code: the Dockerfile as BuildKit's parser reads it (PyPI's
`dockerfile`, which wraps it), .dockerignore as Docker's Python SDK reads and applies it
when it sends a context (`docker.utils.build.exclude_paths`).
"""
from __future__ import annotations

import posixpath
import re
from pathlib import Path

import dockerfile
from docker.utils.build import exclude_paths
from docker.utils.fnmatch import fnmatchcase


def context_files(root: Path, ignore_text: str | None = None) -> set[str]:
    """Every file (relative, '/'-separated) an engine sends from ``root`` (a link as the link)."""
    if ignore_text is None:
        ignore = root / ".dockerignore"
        ignore_text = ignore.read_text() if ignore.exists() else ""
    patterns = [line.strip() for line in ignore_text.splitlines()  # as docker.api.build reads the file
                if line.strip() and not line.strip().startswith("#")]
    return {p for p in exclude_paths(str(root), patterns) if (root / p).is_symlink() or not (root / p).is_dir()}


def copies(dockerfile_text: str, context_only: bool = True) -> list[dockerfile.Command]:
    """The COPY and ADD instructions; with ``context_only``, those that read the build
    context (not COPY --from another stage or image)."""
    return [c for c in dockerfile.parse_string(dockerfile_text) if c.cmd in ("COPY", "ADD")
            and not (context_only and any(f.startswith("--from=") for f in c.flags))]


def copy_sources(dockerfile_text: str) -> list[str]:
    """The context paths every COPY/ADD reads (ADD of a URL aside)."""
    return [s for c in copies(dockerfile_text) for s in c.value[:-1] if not re.match(r"^[a-z]+://", s)]


def missing_sources(root: Path, dockerfile_text: str, ignore_text: str | None = None) -> list[str]:
    """The COPY/ADD sources that bring nothing from the context: a file left out, or a
    directory or wildcard none of whose files is sent."""
    files = context_files(root, ignore_text)
    missing = []
    for source in copy_sources(dockerfile_text):
        if "$" in source:
            raise ValueError(f"COPY source {source!r} uses a variable: cannot check it")
        cleaned = posixpath.normpath(source).lstrip("/") or "."
        if cleaned == ".":
            found = bool(files)
        else:  # the file itself, or any file below the folder (or the wildcard's matches)
            found = any(fnmatchcase(f, cleaned) or any(fnmatchcase("/".join(f.split("/")[:i]), cleaned)
                                                        for i in range(1, f.count("/") + 1)) for f in files)
        if not found:
            missing.append(source)
    return missing
