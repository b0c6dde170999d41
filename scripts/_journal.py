"""Swap new contents into an SGLang tree all at once, or not at all, under any fault.

Protocol (one transaction = the files one apply or reverse changes):

1. prepare: a journal (``<package>/.sglang-series-journal``, written to a temporary
   name and renamed) lists every file with the sha256 of its old and new bytes. Beside
   each target, in the same folder, the new bytes go to ``.NAME.sglang-series-new``
   (flushed to disk, the target's mode and owner copied) and the target gets a second
   name, ``.NAME.sglang-series-old`` (a hard link: the original file itself, kept).
2. swap: the journal says "swap"; each new file is renamed over its target
   (os.replace: atomic, so no target is ever missing or half written).
3. done: the journal says "done"; the old names are removed, then the journal.

Before the swap, the compiled bytecode of every .py file being changed is removed
(``__pycache__/NAME.*.pyc``): a .pyc checked by hash, or not checked at all
(``--invalidation-mode unchecked-hash``), would otherwise keep Python running the old
code. Python compiles the new file again on its next import.

A failure (a folder that refuses new files, an immutable file, a full disk) raises
before or during the swap and is undone on the spot. A process that dies (SIGKILL,
power loss) leaves the journal, and the next apply, reverse or status finishes the
job first: a journal in prepare or swap rolls back (each target whose bytes are the
new ones gets its old file back), one in done rolls forward (only clean-up was left).
A file that no longer holds what the journal expects (changed since, or its old copy
gone) is left as it is and named; the journal is removed either way, so the tree is
never locked: the scripts' survey then judges such a file like any other.
SIGINT, SIGTERM and SIGHUP are held while a transaction (or a recovery) runs: one that
arrives before the swap cancels it (nothing changed), one after lets it finish first.

Tests reach every step through two environment variables: SGLANG_SERIES_TRACE names a
file that receives each step's name as it is reached, and SGLANG_SERIES_FAULT=STEP
kills the process with SIGKILL at that step; STEP:ERRNO (e.g. ``write:3:ENOSPC``)
raises that OSError there instead, and STEP:SIGNAL (e.g. ``swap:2:SIGTERM``) sends the
process that signal there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

JOURNAL = ".sglang-series-journal"
NEW_SUFFIX = ".sglang-series-new"
OLD_SUFFIX = ".sglang-series-old"
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class JournalError(Exception):
    """The tree is in a state this module will not touch; the message says why."""


class Interrupted(Exception):
    def __init__(self, signum: int, finished: bool):
        self.signum, self.finished = signum, finished
        super().__init__(signal.Signals(signum).name)


@dataclass(frozen=True)
class Change:
    path: Path  # the target file
    new: bytes

    def sidecar(self, suffix: str) -> Path:
        return self.path.with_name(f".{self.path.name}{suffix}")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _checkpoint(step: str) -> None:
    trace = os.environ.get("SGLANG_SERIES_TRACE")
    if trace:
        with open(trace, "a") as handle:
            handle.write(step + "\n")
    fault = os.environ.get("SGLANG_SERIES_FAULT", "")
    name, _, kind = fault.rpartition(":")
    if not kind.isupper():  # no ERRNO or SIGNAL after the step's name
        name, kind = fault, ""
    if fault and name == step:
        if kind.startswith("SIG"):  # as if a user or a supervisor sent it right now
            os.kill(os.getpid(), getattr(signal, kind))
        elif kind:
            code = getattr(errno, kind)
            raise OSError(code, f"{os.strerror(code)} (injected at {step})")
        else:
            os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes, like: os.stat_result | None = None) -> None:
    """Write ``data`` to a new file at ``path`` (replacing a stale one), flushed to disk."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        if like is not None:
            os.fchmod(fd, like.st_mode & 0o7777)
            if os.geteuid() == 0:
                os.fchown(fd, like.st_uid, like.st_gid)
    finally:
        os.close(fd)


class Journal:
    def __init__(self, package_dir: Path):
        self.package_dir = package_dir
        self.path = package_dir / JOURNAL
        self.temp = package_dir / (JOURNAL + ".tmp")

    def exists(self) -> bool:
        return self.path.exists() or self.temp.exists()

    def write(self, phase: str, verb: str, entries: list[dict]) -> None:
        _write_file(self.temp, json.dumps({"phase": phase, "verb": verb, "files": entries}, indent=1).encode())
        os.replace(self.temp, self.path)
        _fsync_dir(self.package_dir)

    def read(self) -> dict:
        try:
            text = self.path.read_text()
        except PermissionError:
            owner = _owner(self.path)
            raise JournalError(
                f"{self.path}: permission denied. An apply or reverse run by {owner} was cut short in this "
                f"tree, and finishing it needs that user's rights: run any of scripts/status, apply or "
                f"reverse on this tree as {owner if owner.startswith('root ') else owner + ' or root'}; "
                "it finishes or undoes that change first")
        try:
            record = json.loads(text)
            assert record["phase"] in ("prepare", "swap", "done") and isinstance(record["files"], list)
            return record
        except (OSError, ValueError, KeyError, AssertionError) as exc:
            raise JournalError(f"{self.path} is unreadable ({exc}); it was not written by these scripts, "
                               "or by a newer version of them: remove it only if no apply or reverse is running")

    def remove(self) -> None:
        for path in (self.path, self.temp):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        _fsync_dir(self.package_dir)


def _owner(path: Path) -> str:
    """The user owning ``path``, by name where there is one."""
    try:
        uid = path.stat().st_uid
    except OSError:
        return "its owner"
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def drop_bytecode(path: Path) -> None:
    """Remove the compiled bytecode of a .py file (every interpreter's and optimization
    level's), so that no .pyc, however it is checked, can stand for its old bytes."""
    if path.suffix != ".py":
        return
    cache = path.parent / "__pycache__"
    if not cache.is_dir():
        return
    for pyc in cache.glob(f"{path.stem}.*.pyc"):
        if pyc.name.split(".")[0] == path.stem:  # not a.b.*.pyc for a.py
            with contextlib.suppress(FileNotFoundError):
                pyc.unlink()


@contextlib.contextmanager
def locked(package_dir: Path):
    """One apply, reverse or status at a time per tree (an advisory lock on its folder)."""
    fd = os.open(package_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JournalError(f"another apply, reverse or status is working on {package_dir}; wait for it")
        yield
    finally:
        os.close(fd)


class _HeldSignals:
    """Record SIGINT/SIGTERM/SIGHUP instead of dying of them, until released."""

    def __enter__(self):
        self.pending = None
        self.previous = {}
        for signum in HELD_SIGNALS:
            self.previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum, frame):
        self.pending = self.pending or signum

    def check(self, finished: bool) -> None:
        """Raise Interrupted for a signal that arrived (a call: Python runs pending
        handlers on entering it)."""
        if self.pending:
            signum, self.pending = self.pending, None
            raise Interrupted(signum, finished)

    def __exit__(self, kind, value, trace):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        if self.pending and kind is None:  # the work is done: report the signal now
            raise Interrupted(self.pending, finished=True)
        return False


def _entry(change: Change, package_dir: Path, old: bytes) -> dict:
    return {"path": str(change.path.relative_to(package_dir)), "old_sha256": sha256(old),
            "new_sha256": sha256(change.new)}


def commit(package_dir: Path, changes: list[Change], verb: str) -> OSError | None:
    """Replace every ``change.path`` with ``change.new``, all or none (see the module doc).

    Raises OSError (after undoing everything) when a step fails, and Interrupted when a
    held signal arrived: ``finished`` says whether the change went through first. Returns
    the error that stopped the clean-up after a change that went through, if one did.
    """
    olds = {c.path: c.path.read_bytes() for c in changes}
    entries = [_entry(c, package_dir, olds[c.path]) for c in changes]
    journal = Journal(package_dir)
    with _HeldSignals() as held:
        _checkpoint("journal:prepare")
        journal.write("prepare", verb, entries)
        swapped = False
        try:
            for number, change in enumerate(changes, 1):
                _checkpoint(f"write:{number}")
                _write_file(change.sidecar(NEW_SUFFIX), change.new, change.path.stat())
                _checkpoint(f"link:{number}")
                _keep_old(change)
                held.check(finished=False)
            _checkpoint("bytecode")
            for change in changes:
                drop_bytecode(change.path)
            _checkpoint("journal:swap")
            held.check(finished=False)
            journal.write("swap", verb, entries)
            swapped = True
            for number, change in enumerate(changes, 1):
                _checkpoint(f"swap:{number}")
                os.replace(change.sidecar(NEW_SUFFIX), change.path)
            for folder in {c.path.parent for c in changes}:
                _fsync_dir(folder)
            _checkpoint("journal:done")
            journal.write("done", verb, entries)
        except BaseException:
            _roll_back(package_dir, journal, entries, swapped)
            raise
        # The change is in; what is left is clean-up, which the next run finishes when
        # it fails here (the journal stays, saying "done").
        leftover = None
        try:
            for number, change in enumerate(changes, 1):
                _checkpoint(f"drop:{number}")
                with contextlib.suppress(FileNotFoundError):
                    change.sidecar(OLD_SUFFIX).unlink()
            _checkpoint("journal:remove")
            journal.remove()
        except OSError as exc:
            leftover = exc
        _checkpoint("finished")
    return leftover


def _keep_old(change: Change) -> None:
    """Give the target a second name, so the swap can be undone; a copy where links fail."""
    old = change.sidecar(OLD_SUFFIX)
    with contextlib.suppress(FileNotFoundError):
        old.unlink()
    try:
        os.link(change.path, old)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        _write_file(old, change.path.read_bytes(), change.path.stat())


def _roll_back(package_dir: Path, journal: Journal, entries: list[dict], swapped: bool) -> tuple[int, list[str]]:
    """Put every swapped file back and remove the side files; returns how many were put
    back, and what was left as it is (a file that holds neither its old nor its new bytes,
    or whose old copy is gone), each with the reason.

    Before the swap (``swapped`` False) no target was touched, so none is restored. An old
    copy that was not put back is kept where its file holds other bytes (it may be the only
    copy of them); the journal is removed in every case.
    """
    restored, left = 0, []
    for entry in entries:
        change = Change(_inside(package_dir, entry["path"]), b"")
        old = change.sidecar(OLD_SUFFIX)
        current = sha256(change.path.read_bytes()) if change.path.exists() else None
        keep_old = False
        if swapped and current != entry["old_sha256"]:
            intact = old.exists() and sha256(old.read_bytes()) == entry["old_sha256"]
            if current == entry["new_sha256"] and intact:
                os.replace(old, change.path)
                drop_bytecode(change.path)
                restored += 1
            elif intact:  # changed since the kill: keep both, name both
                keep_old = True
                left.append(f"{change.path} changed since (its bytes before the change are in {old})")
            elif current == entry["new_sha256"]:
                left.append(f"{change.path} keeps the new bytes (its old copy is gone)")
            else:
                left.append(f"{change.path} holds neither its old nor its new bytes")
        for side in ((change.sidecar(NEW_SUFFIX),) if keep_old else (old, change.sidecar(NEW_SUFFIX))):
            with contextlib.suppress(FileNotFoundError):
                side.unlink()
    journal.remove()
    return restored, left


def _inside(package_dir: Path, relative: str) -> Path:
    path = package_dir / relative
    if Path(relative).is_absolute() or ".." in Path(relative).parts:
        raise JournalError(f"{package_dir / JOURNAL} names {relative!r}, outside {package_dir}")
    return path


def _roll_forward(package_dir: Path, journal: Journal, entries: list[dict]) -> list[str]:
    """Remove what a change that went through left; returns the files changed since."""
    left = []
    for entry in entries:
        target = _inside(package_dir, entry["path"])
        change = Change(target, b"")
        if not target.exists() or sha256(target.read_bytes()) != entry["new_sha256"]:
            left.append(f"{target} changed since")
        else:
            drop_bytecode(target)
        for side in (change.sidecar(OLD_SUFFIX), change.sidecar(NEW_SUFFIX)):
            with contextlib.suppress(FileNotFoundError):
                side.unlink()
    journal.remove()
    return left


def recover(package_dir: Path) -> str | None:
    """Finish what an interrupted transaction left; returns what was done, or None."""
    journal = Journal(package_dir)
    if not journal.path.exists():
        if journal.temp.exists():  # died while writing the first journal: nothing else exists
            journal.remove()
        return None
    record = journal.read()
    with _HeldSignals():
        if record["phase"] == "done":
            left = _roll_forward(package_dir, journal, record["files"])
            note = f"finished an interrupted {record['verb']} (it had swapped every file in)"
        else:
            restored, left = _roll_back(package_dir, journal, record["files"], swapped=record["phase"] == "swap")
            note = (f"rolled back an interrupted {record['verb']}: {restored} of {len(record['files'])} files "
                    "put back as they were")
    if left:
        note += "; left as they are: " + "; ".join(left)
    return note
