"""The build context an engine sends for a Dockerfile, computed from .dockerignore by
Docker's own rules, and the COPY/ADD sources that the context lacks.

The rules (Docker's reference, "dockerignore file", as its patternmatcher implements
them): one pattern a line; '#' starts a comment line; surrounding blanks are dropped;
each pattern is cleaned as a path (``./a//b/`` is ``a/b``, a leading ``/`` is the
context's root); ``*`` is any run of characters but ``/``, ``?`` one such character,
``[...]`` a class (a regular expression's), ``\\`` escapes; ``**`` is any number of directories, none included;
a pattern that matches a directory matches everything below it; ``!`` makes a
pattern an exception; of all patterns that match a path, the last one decides.
"""
from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pattern:
    text: str
    exclusion: bool
    regex: re.Pattern
    cleaned: str = ""

    def may_match_below(self, directory: str) -> bool:
        """Whether this pattern can match a path under ``directory``: a path it matches
        starts with its text up to the first wildcard."""
        literal = re.split(r"[*?\\[\\\\]", self.cleaned, maxsplit=1)[0]
        below = directory + "/"
        return literal.startswith(below) or below.startswith(literal)

    def matches(self, path: str) -> bool:
        """The path itself or any directory above it."""
        if self.regex.match(path):
            return True
        parts = path.split("/")
        return any(self.regex.match("/".join(parts[:i])) for i in range(1, len(parts)))


def _compile(pattern: str) -> re.Pattern:
    out, i, n = "^", 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            if i + 1 < n and pattern[i + 1] == "*":
                i += 1
                if i + 1 < n and pattern[i + 1] == "/":
                    i += 1
                out += ".*" if i + 1 == n else "(.*/)?"
            else:
                out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "\\" and i + 1 < n:
            i += 1
            out += re.escape(pattern[i])
        elif c == "[":
            # Passed to the regular expression as it stands, as patternmatcher does
            # (so "[^a]" negates, "[!a]" is the class of "!" and "a").
            end = pattern.find("]", i + 2)
            if end < 0:
                raise ValueError(f"bad pattern {pattern!r}: '[' without ']'")
            out += pattern[i:end + 1]
            i = end
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + "$", re.S)


def parse_dockerignore(text: str) -> list[Pattern]:
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        if exclusion:
            line = line[1:].strip()
        cleaned = posixpath.normpath(line)
        if cleaned.startswith("/"):
            cleaned = cleaned.lstrip("/") or "."
        patterns.append(Pattern(line, exclusion, _compile(cleaned), cleaned))
    return patterns


def excluded(path: str, patterns: list[Pattern]) -> bool:
    verdict = False
    for pattern in patterns:
        if pattern.matches(path):
            verdict = not pattern.exclusion
    return verdict


def context_files(root: Path, ignore_text: str | None = None) -> set[str]:
    """Every file (relative, '/'-separated) an engine sends from ``root``. A folder that
    is left out, and under which no exception pattern could let a path in, is not
    walked (a checkout's .venv holds some 100,000 files)."""
    if ignore_text is None:
        ignore = root / ".dockerignore"
        ignore_text = ignore.read_text() if ignore.exists() else ""
    patterns = parse_dockerignore(ignore_text)
    exceptions = [p for p in patterns if p.exclusion]
    out = set()
    for top, dirs, names in os.walk(root):
        base = Path(top).relative_to(root).as_posix()
        prefix = "" if base == "." else base + "/"
        kept = []
        for name in dirs:
            rel = prefix + name
            if os.path.islink(os.path.join(top, name)):
                names.append(name)  # sent as the link itself, not followed
            elif not excluded(rel, patterns) or any(p.may_match_below(rel) for p in exceptions):
                kept.append(name)
        dirs[:] = kept
        out.update(prefix + name for name in names if not excluded(prefix + name, patterns))
    return out


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile in order, continuation lines joined,
    comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def copy_sources(dockerfile_text: str) -> list[str]:
    """The context paths every COPY/ADD reads (not those COPY --from another stage or
    image, nor ADD of a URL)."""
    sources = []
    for keyword, args in instructions(dockerfile_text):
        if keyword not in ("COPY", "ADD"):
            continue
        flags = []
        while args.startswith("--"):
            flag, _, args = args.partition(" ")
            flags.append(flag)
            args = args.lstrip()
        words = json.loads(args) if args.startswith("[") else shlex.split(args)
        if any(f.startswith("--from=") for f in flags) or len(words) < 2:
            continue
        sources += [w for w in words[:-1] if not re.match(r"^[a-z]+://", w)]
    return sources


def _source_glob(source: str) -> re.Pattern:
    return _compile(posixpath.normpath(source).lstrip("/"))


def missing_sources(root: Path, dockerfile_text: str, ignore_text: str | None = None) -> list[str]:
    """The COPY/ADD sources that bring nothing from the context: a file left out, or a
    directory or wildcard none of whose files is sent."""
    files = context_files(root, ignore_text)
    missing = []
    for source in copy_sources(dockerfile_text):
        if "$" in source:
            raise ValueError(f"COPY source {source!r} uses a variable: cannot check it")
        cleaned = posixpath.normpath(source).lstrip("/")
        if cleaned == ".":
            found = bool(files)
        elif any(ch in cleaned for ch in "*?["):
            rx = _source_glob(cleaned)
            found = any(rx.match(f) or any(rx.match("/".join(f.split("/")[:i]))
                                           for i in range(1, f.count("/") + 1)) for f in files)
        else:
            found = cleaned in files or any(f.startswith(cleaned + "/") for f in files)
        if not found:
            missing.append(source)
    return missing
