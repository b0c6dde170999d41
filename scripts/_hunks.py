"""The series' hunks, applied and recognised in memory, byte for byte.

A file the series touches holds SGLang's pristine text plus some subset of the series'
hunks: all of them, none, the first patches' (applied by hand), or any mix an
interrupted tool or `patch` with rejects leaves. ``analyse`` tells which hunks a file
holds by undoing, last to first, every hunk whose new side is present; what remains
must be SGLang's pristine file, which the series itself names: git format-patch
--full-index writes every file's blob id before and after each patch
("index <old>..<new>"). The pristine text plus all hunks is the patched file.

Hunks are placed the way ``git apply`` places them (no fuzz; the nearest exact match
of the whole hunk to the line it names; a hunk starting at line 1 must match at the
top, one without trailing context at the end), and scripts/check proves this module
and git produce the same bytes.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

HUNK_HEADER = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
INDEX_LINE = re.compile(rb"^index ([0-9a-f]+)\.\.([0-9a-f]+)(?: \d+)?$")
UNSUPPORTED = (b"new file mode", b"deleted file mode", b"old mode", b"new mode", b"similarity index",
               b"rename from", b"copy from", b"Binary files", b"GIT binary patch")


class PatchError(Exception):
    """A patch file this module cannot read; the message names the file and line."""


@dataclass(frozen=True)
class Hunk:
    patch: str  # the patch file's name
    number: int  # 1-based, counted over the whole patch
    path: str  # upstream path, python/sglang/...
    old_start: int
    new_start: int
    old: tuple[bytes, ...]  # lines with their endings
    new: tuple[bytes, ...]
    trailing: int  # context lines after the last change

    @property
    def label(self) -> str:
        return f"{self.patch} hunk {self.number} ({self.path}, line {self.old_start})"


@dataclass(frozen=True)
class FileDiff:
    path: str
    old_blob: str | None  # git blob id before the patch (may be abbreviated)
    new_blob: str | None
    hunks: tuple[Hunk, ...]


@dataclass(frozen=True)
class Patch:
    name: str
    message: bytes  # everything before the first "diff --git"
    files: tuple[FileDiff, ...]

    @property
    def hunks(self) -> list[Hunk]:
        return [h for f in self.files for h in f.hunks]


def blob_id(data: bytes) -> str:
    """git's object id of a file with these bytes (git hash-object)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def same_blob(full: str, named: str | None) -> bool:
    return named is not None and full.startswith(named)


def parse_patch(path: Path) -> Patch:
    lines = path.read_bytes().splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.startswith(b"diff --git ")]
    if not starts:
        raise PatchError(f"{path.name}: no 'diff --git' section")
    files, hunk_count = [], 0
    for begin, end in zip(starts, starts[1:] + [len(lines)]):
        diff = _parse_file(path.name, lines, begin, end, hunk_count)
        hunk_count += len(diff.hunks)
        files.append(diff)
    return Patch(path.name, b"".join(lines[: starts[0]]), tuple(files))


def _parse_file(name: str, lines: list[bytes], begin: int, end: int, numbered: int) -> FileDiff:
    where = f"{name} line {begin + 1}"
    match = re.match(rb"^diff --git a/(\S+) b/(\S+)\s*$", lines[begin])
    if not match or match.group(1) != match.group(2):
        raise PatchError(f"{where}: expected 'diff --git a/PATH b/PATH' with one path")
    path = match.group(1).decode()
    old_blob = new_blob = None
    i = begin + 1
    while i < end and not lines[i].startswith(b"--- "):
        if lines[i].startswith(UNSUPPORTED):
            raise PatchError(f"{name}: {path}: only changes to existing text files are supported, "
                             f"not '{lines[i].decode(errors='replace').strip()}'")
        index = INDEX_LINE.match(lines[i].rstrip(b"\n"))
        if index:
            old_blob, new_blob = index.group(1).decode(), index.group(2).decode()
        i += 1
    if i + 1 >= end or not lines[i + 1].startswith(b"+++ "):
        raise PatchError(f"{where}: {path} has no ---/+++ lines")
    i += 2
    hunks = []
    while i < end and lines[i].startswith(b"@@"):
        hunk, i = _parse_hunk(name, path, lines, i, end, numbered + len(hunks) + 1)
        hunks.append(hunk)
    if not hunks:
        raise PatchError(f"{where}: {path} has no hunk")
    return FileDiff(path, old_blob, new_blob, tuple(hunks))


def _parse_hunk(name, path, lines, i, end, number) -> tuple[Hunk, int]:
    header = HUNK_HEADER.match(lines[i])
    if not header:
        raise PatchError(f"{name} line {i + 1}: bad hunk header")
    old_start, new_start = int(header.group(1)), int(header.group(3))
    old_left = int(header.group(2) or b"1")
    new_left = int(header.group(4) or b"1")
    old, new, kinds = [], [], []
    i += 1
    while old_left or new_left:
        if i >= end:
            raise PatchError(f"{name}: hunk {number} of {path} ends early")
        line = lines[i]
        tag, text = line[:1], line[1:]
        if line == b"\n":  # an empty context line whose leading space was lost
            tag, text = b" ", b"\n"
        if tag == b" " and old_left and new_left:
            old.append(text), new.append(text)
            old_left, new_left = old_left - 1, new_left - 1
        elif tag == b"-" and old_left:
            old.append(text)
            old_left -= 1
        elif tag == b"+" and new_left:
            new.append(text)
            new_left -= 1
        elif tag == b"\\":
            _drop_newline(kinds[-1] if kinds else None, old, new)
            i += 1
            continue
        else:
            raise PatchError(f"{name} line {i + 1}: hunk {number} of {path} does not match its header")
        kinds.append(tag)
        i += 1
    if i < end and lines[i].startswith(b"\\"):
        _drop_newline(kinds[-1] if kinds else None, old, new)
        i += 1
    trailing = 0
    for kind in reversed(kinds):
        if kind != b" ":
            break
        trailing += 1
    return Hunk(name, number, path, old_start, new_start, tuple(old), tuple(new), trailing), i


def _drop_newline(kind, old, new):
    """'\\ No newline at end of file': the line before it has no line ending."""
    for image, owns in ((old, kind in (b" ", b"-")), (new, kind in (b" ", b"+"))):
        if owns and image and image[-1].endswith(b"\n"):
            image[-1] = image[-1][:-1]


def _find(lines: list[bytes], image: tuple[bytes, ...], guess: int, at_start: bool, at_end: bool) -> int | None:
    """Where ``image`` sits in ``lines``: the match nearest ``guess`` (earlier first)."""
    size = len(image)
    last = len(lines) - size
    if last < 0:
        return None

    def matches(pos: int) -> bool:
        return 0 <= pos <= last and (size == 0 or lines[pos] == image[0]) and tuple(lines[pos:pos + size]) == image

    if at_start or at_end:
        pos = 0 if at_start else last
        if at_start and at_end and last != 0:
            return None
        return pos if matches(pos) else None
    guess = min(max(guess, 0), last)
    for distance in range(0, max(guess, last - guess) + 1):
        for pos in (guess - distance, guess + distance) if distance else (guess,):
            if matches(pos):
                return pos
    return None


def _place(lines: list[bytes], hunk: Hunk, reverse: bool) -> bool:
    """Apply (or undo) one hunk in ``lines``; False when its side is not there."""
    image, replacement = (hunk.new, hunk.old) if reverse else (hunk.old, hunk.new)
    start = hunk.new_start if reverse else hunk.old_start
    # Hunks are placed top to bottom when applied and bottom to top when undone, so
    # the lines above a hunk are in its new coordinates either way (git apply guesses
    # the new line number too).
    pos = _find(lines, image, hunk.new_start - 1, at_start=start <= 1, at_end=hunk.trailing == 0)
    if pos is None:
        return False
    lines[pos:pos + len(image)] = replacement
    return True


def apply_hunks(data: bytes, hunks: list[Hunk]) -> tuple[bytes | None, Hunk | None]:
    """``data`` with ``hunks`` applied in order, or (None, the first that does not apply)."""
    lines = data.splitlines(keepends=True)
    for hunk in hunks:
        if not _place(lines, hunk, reverse=False):
            return None, hunk
    return b"".join(lines), None


@dataclass
class FileState:
    """What one file holds of the series."""

    path: str
    hunks: list[Hunk]
    present: bool = True
    applied: list[bool] = field(default_factory=list)  # per hunk, in series order
    pristine: bytes | None = None  # the file without any of the series' hunks
    patched: bytes | None = None  # the file with all of them
    conflict: str | None = None  # why the file is not pristine SGLang plus some hunks
    local_edits: bool = False  # the pristine text differs from SGLang's (per the series)

    @property
    def consistent(self) -> bool:
        return self.present and self.conflict is None


def analyse(path: str, data: bytes | None, hunks: list[Hunk], pristine_blob: str | None) -> FileState:
    """Which of ``hunks`` (one file's, in series order) ``data`` holds."""
    state = FileState(path, hunks)
    if data is None:
        state.present = False
        state.applied = [False] * len(hunks)
        state.conflict = "missing"
        return state
    lines = data.splitlines(keepends=True)
    applied = [False] * len(hunks)
    for index in reversed(range(len(hunks))):
        applied[index] = _place(lines, hunks[index], reverse=True)
    state.applied = applied
    state.pristine = b"".join(lines)
    # Undoing then redoing the hunks found must give the file back, and the whole
    # series must apply to what is left: otherwise the file is something else.
    replay, failed = apply_hunks(state.pristine, [h for h, a in zip(hunks, applied) if a])
    if replay != data:
        state.conflict = f"{failed.label if failed else 'its hunks'} cannot be told apart from local edits"
        return state
    state.patched, failed = apply_hunks(state.pristine, hunks)
    if failed is not None:
        state.conflict = f"{failed.label} is neither applied nor applicable"
        return state
    if pristine_blob is not None and not same_blob(blob_id(state.pristine), pristine_blob):
        state.local_edits = True
    return state
