"""Shared logic of the patch-series scripts: the pin, the series, the target tree.

The series lives in ``patches/series`` (one ``NNNN-subject.patch`` per line, in order);
the SGLang release it is for is pinned in ``sglang.pin``. Patches carry upstream paths
(``a/python/sglang/...``). A target is either

* an upstream checkout: a folder holding ``python/sglang/``,
* an installed SGLang: a folder holding ``sglang/`` directly, such as site-packages or
  ``/sgl-workspace/sglang/python``, or
* the ``sglang`` package folder itself (taken as installed in its parent folder).

``survey`` reads what a target holds of the series, hunk by hunk (scripts/_hunks.py);
scripts/apply and scripts/reverse then write the files they change in one journaled
transaction (scripts/_journal.py), which every verb first recovers if one was cut short.
"""

from __future__ import annotations

import contextlib
import csv
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _hunks  # noqa: E402
import _journal  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "patches"
SERIES_FILE = PATCH_DIR / "series"
PIN_FILE = ROOT / "sglang.pin"
UPSTREAM_PREFIX = "python/"


class SeriesError(Exception):
    """A condition the user must fix; the message says what and how."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def read_pin(path: Path = PIN_FILE) -> dict[str, str]:
    """sglang.pin: KEY=value lines (the same file bash sources and make includes)."""
    if not path.is_file():
        raise SeriesError(f"{path} is missing: it pins the SGLang release the series is for")
    pin = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            if not sep or not re.fullmatch(r"[A-Z_]+", key) or not re.fullmatch(r"[^\s\"']+", value):
                raise SeriesError(f"{path}:{number}: expected KEY=value without quotes or spaces")
            pin[key] = value
    for key in ("SGLANG_VERSION", "SGLANG_COMMIT"):
        if key not in pin:
            raise SeriesError(f"{path} does not set {key}")
    return pin


try:
    PIN = read_pin()
except SeriesError as _exc:  # every script imports this module first: one line, not a traceback
    print(f"error: {_exc}", file=sys.stderr)
    sys.exit(1)
EXPECTED_VERSION = PIN["SGLANG_VERSION"]
UPSTREAM_COMMIT = PIN["SGLANG_COMMIT"]


def series_edited() -> bool:
    """patches/series differs from the one committed in this repository (False where this
    is no git checkout, as in the image)."""
    proc = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", str(SERIES_FILE)],
                          capture_output=True)
    return proc.returncode == 1


def series_note() -> str:
    return (" (patches/series differs from the committed one, so the series read is the edited one: "
            "git diff -- patches/series shows how; git checkout -- patches/series restores it)"
            if series_edited() else "")


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


def _same_blob(a: str | None, b: str | None) -> bool:
    """Two (possibly abbreviated) blob ids name the same blob; unknown ones match anything."""
    return not a or not b or a.startswith(b) or b.startswith(a)


class Series:
    """The parsed patches, and per file the hunks that touch it in series order."""

    def __init__(self, paths: list[Path]):
        try:
            self.patches = [_hunks.parse_patch(p) for p in paths]
        except (OSError, _hunks.PatchError) as exc:
            raise SeriesError(str(exc))
        self.paths: list[str] = []
        self._hunks: dict[str, list[_hunks.Hunk]] = {}
        self._blobs: dict[str, list[str | None]] = {}
        last: dict[str, str] = {}  # per file, the patch that touched it last
        for patch in self.patches:
            for diff in patch.files:
                if diff.path not in self._hunks:
                    self.paths.append(diff.path)
                    self._hunks[diff.path], self._blobs[diff.path] = [], [diff.old_blob]
                elif not _same_blob(self._blobs[diff.path][-1], diff.old_blob):
                    raise SeriesError(
                        f"{SERIES_FILE}: {patch.name} changes {diff.path} as {last[diff.path]} leaves it in "
                        f"another form (blob {diff.old_blob}, not {self._blobs[diff.path][-1]}): a patch is "
                        f"missing, added or out of order{series_note()}")
                last[diff.path] = patch.name
                self._hunks[diff.path] += diff.hunks
                self._blobs[diff.path].append(diff.new_blob)

    @classmethod
    def load(cls) -> "Series":
        return cls(read_series())

    def hunks(self, path: str) -> list[_hunks.Hunk]:
        return self._hunks[path]

    def pristine_blob(self, path: str) -> str | None:
        """SGLang's own file, as the first patch that touches it names it."""
        return self._blobs[path][0]


@dataclass(frozen=True)
class Target:
    """Where SGLang's sources live and how patch paths map onto them."""

    root: Path
    layout: str  # "checkout" (root/python/sglang) or "installed" (root/sglang)

    @property
    def package_dir(self) -> Path:
        return self.root / "python" / "sglang" if self.layout == "checkout" else self.root / "sglang"

    def local_path(self, upstream_path: str) -> Path:
        if self.layout == "checkout":
            return self.root / upstream_path
        return self.root / upstream_path[len(UPSTREAM_PREFIX):]

    def show(self, upstream_path: str) -> str:
        """A touched file as the user knows it: relative to the folder they named."""
        return str(self.local_path(upstream_path).relative_to(self.root))


def _is_package(folder: Path) -> bool:
    return (folder / "__init__.py").is_file()


def find_target(path: str | os.PathLike) -> Target:
    root = Path(path).resolve()
    if not root.is_dir():
        raise SeriesError(f"{path}: no such directory")
    checkout = _is_package(root / "python" / "sglang")
    installed = _is_package(root / "sglang")
    if checkout and installed:
        raise SeriesError(
            f"{path} holds two SGLang packages, {root / 'python' / 'sglang'} (an upstream checkout) and "
            f"{root / 'sglang'} (an installed package); which one Python imports depends on its search "
            "path, so name the package folder you mean instead: "
            f"{root / 'python' / 'sglang'} or {root / 'sglang'} (scripts/install-into-python --python PY "
            "finds the one PY imports)")
    if checkout:
        return Target(root, "checkout")
    if installed:
        return Target(root, "installed")
    if root.name == "sglang" and _is_package(root) and (root / "srt").is_dir():
        return Target(root.parent, "installed")
    raise SeriesError(
        f"{path} is not an SGLang tree: expected python/sglang/ (an upstream checkout) or sglang/ "
        "(an installed SGLang, e.g. site-packages) inside it, or the sglang package folder itself"
    )


def _read_version_file(package_dir: Path) -> str | None:
    version_file = package_dir / "_version.py"
    if not version_file.is_file():
        return None
    match = re.search(r"^__version__\s*=.*?['\"]([^'\"]+)['\"]", version_file.read_text(), re.M)
    return match.group(1) if match else None


def _metadata_version(dist_info: Path) -> str | None:
    metadata = dist_info / "METADATA"
    if metadata.is_file():
        for line in metadata.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
            if not line:
                break
    return None


def _records_package(dist_info: Path) -> bool:
    record = dist_info / "RECORD"
    if not record.is_file():
        return False
    with record.open(newline="") as handle:
        return any(row and row[0] == "sglang/__init__.py" for row in csv.reader(handle))


def owning_dist_info(root: Path) -> Path | None:
    """The sglang-*.dist-info that installed root/sglang, or None when there is none.

    A stale dist-info (an upgrade pip did not finish, a copied folder) can sit beside the
    real one: only those whose RECORD lists sglang/__init__.py count, and two of those
    are a tree nobody can tell apart: refused. (The package's own _version.py, read
    first, is what pip and Python see; the dist-info is asked only when it is missing.)
    """
    candidates = sorted(p for p in root.glob("*.dist-info")
                        if p.name.lower().startswith("sglang-") and _records_package(p))
    if len(candidates) > 1:
        raise SeriesError(
            f"{root} holds {len(candidates)} dist-info folders that each claim sglang/ "
            f"({', '.join(p.name for p in candidates)}); remove the stale one(s) "
            "(pip install --force-reinstall --no-deps sglang==VERSION rewrites the right one)")
    return candidates[0] if candidates else None


def _git_head(folder: Path) -> str | None:
    proc = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def detect_version(target: Target) -> str:
    """The SGLang version of a tree, from the package's own metadata.

    In order: the generated ``sglang/_version.py`` (wheels, installs, built checkouts),
    the dist-info that installed the package, then for a bare upstream checkout its git
    commit (the pinned commit counts as the pinned version).
    """
    version = _read_version_file(target.package_dir)
    if version is None:
        dist_info = owning_dist_info(target.root)
        version = _metadata_version(dist_info) if dist_info else None
    if version is None:
        head = _git_head(target.package_dir)
        if head == UPSTREAM_COMMIT:
            version = EXPECTED_VERSION
        elif head:
            version = f"unknown (git commit {head})"
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


PATCH_LEFTOVERS = (".orig", ".rej")


@dataclass
class PatchState:
    name: str
    state: str  # applied | not applied | partly applied | conflicting
    detail: str = ""


@dataclass
class Survey:
    """What a target holds of the series: per file, per patch, and files that should not be there."""

    target: Target
    series: Series
    files: dict[str, _hunks.FileState]
    foreign: list[Path] = field(default_factory=list)

    @cached_property
    def patches(self) -> list[PatchState]:
        applied = {}
        for state in self.files.values():
            applied.update({(h.patch, h.number): a for h, a in zip(state.hunks, state.applied)})
        out = []
        for patch in self.series.patches:
            broken = [self.files[d.path] for d in patch.files if not self.files[d.path].consistent]
            if broken:
                out.append(PatchState(patch.name, "conflicting", "; ".join(
                    f"{self.target.show(f.path)}: {f.conflict}" for f in broken)))
                continue
            flags = [applied[(patch.name, h.number)] for h in patch.hunks]
            if all(flags):
                out.append(PatchState(patch.name, "applied"))
            elif not any(flags):
                out.append(PatchState(patch.name, "not applied"))
            else:
                out.append(PatchState(patch.name, "partly applied", f"{sum(flags)} of {len(flags)} hunks in"))
        return out

    @property
    def state(self) -> str:
        """applied, pristine (none of the series in), partial, or conflicting."""
        states = {p.state for p in self.patches}
        if "conflicting" in states:
            return "conflicting"
        if states == {"applied"}:
            return "applied"
        if states == {"not applied"}:
            return "pristine"
        return "partial"

    @property
    def missing(self) -> list[str]:
        return [p for p, f in self.files.items() if not f.present]

    @property
    def conflicts(self) -> list[_hunks.FileState]:
        return [f for f in self.files.values() if f.present and f.conflict]

    @property
    def local_edits(self) -> list[str]:
        return [p for p, f in self.files.items() if f.consistent and f.local_edits]


def survey(target: Target, series: Series) -> Survey:
    files = {}
    foreign = []
    for path in series.paths:
        local = target.local_path(path)
        data = local.read_bytes() if local.is_file() else None
        files[path] = _hunks.analyse(path, data, series.hunks(path), series.pristine_blob(path))
        for leftover in [local.with_name(local.name + s) for s in PATCH_LEFTOVERS] + [
                local.with_name(f".{local.name}{s}") for s in (_journal.NEW_SUFFIX, _journal.OLD_SUFFIX)]:
            if leftover.exists():
                foreign.append(leftover)
    return Survey(target, series, files, foreign)


def restore_hint(target: Target, paths: list[str]) -> str:
    """How to bring SGLang's own copy of files back."""
    shown = " ".join(target.show(p) for p in paths)
    return (f"restore {shown} from SGLang {EXPECTED_VERSION} (in a git checkout: git -C {target.root} "
            f"checkout -- {shown}; installed: pip install --force-reinstall --no-deps sglang=={EXPECTED_VERSION})")


@contextlib.contextmanager
def opened(path: str):
    """What every verb does first, under the tree's lock: find the tree, finish a change
    that was cut short (scripts/_journal.py), check the version, read the series."""
    target = find_target(path)
    try:
        with _journal.locked(target.package_dir):
            note = _journal.recover(target.package_dir)
            if note:
                print(f"note: {target.package_dir}: {note}", file=sys.stderr)
            _journal._checkpoint("opened")  # tests: a signal here is one before anything is written
            yield target, check_version(target), Series.load()
    except _journal.JournalError as exc:
        raise SeriesError(str(exc))
    except _journal.Interrupted as exc:  # while recovering: the recovery was finished first
        raise SeriesError(f"{exc} received: the interrupted change was recovered first, then stopped",
                          128 + exc.signum)
    except PermissionError as exc:
        owner = _journal._owner(target.package_dir)
        raise SeriesError(f"{exc}: permission denied; run as a user who can write {target.package_dir} "
                          f"({owner if owner.startswith('root ') else owner + ' or root'})")


def write(target: Target, changes: dict[str, bytes], verb: str) -> None:
    """Swap the new bytes of every upstream path in ``changes`` into the tree, all or none.
    (A symbolic link among them is refused before: refuse_unsafe.)"""
    items = [_journal.Change(target.local_path(p), data) for p, data in changes.items()]
    try:
        leftover = _journal.commit(target.package_dir, items, verb)
    except _journal.Interrupted as exc:
        code = 128 + exc.signum
        if exc.finished:
            raise SeriesError(f"{exc} received during the swap: the {verb} was finished first, then stopped", code)
        raise SeriesError(f"{exc} received: the {verb} was cancelled before any file changed; nothing changed", code)
    except OSError as exc:
        raise SeriesError(f"{verb} failed, every file is back as it was; nothing changed: {exc}")
    if leftover:
        print(f"note: the {verb} went through, but removing its side files failed ({leftover}); "
              "the next apply, reverse or status removes them", file=sys.stderr)


def symlinks(target: Target, paths) -> list[tuple[str, Path]]:
    """The series' files that are symbolic links, with where each points."""
    return [(p, Path(os.readlink(target.local_path(p)))) for p in paths if target.local_path(p).is_symlink()]


def force_hint() -> str:
    """How the user passes --force: the Makefile sets SERIES_FORCE_HINT=FORCE=1."""
    return os.environ.get("SERIES_FORCE_HINT") or "--force"


def leftovers_note(survey: Survey) -> str | None:
    """A line naming files patch tools left beside the series' files (.rej, .orig), which
    the scripts never remove: they did not write them."""
    left = [p for p in survey.foreign if p.name.endswith(PATCH_LEFTOVERS)]
    if not left:
        return None
    return (f"note: left by a patch tool, not part of SGLang, and kept: "
            f"{', '.join(str(p.relative_to(survey.target.root)) for p in left)} (remove them when done with them)")


def refuse_unsafe(survey: Survey, verb: str, force: bool) -> None:
    """Stop before writing when the tree is not SGLang's files plus some of the series' hunks."""
    target = survey.target
    links = symlinks(target, [p for p, f in survey.files.items() if f.present])
    if links:
        raise SeriesError(
            "files the series changes are symbolic links, which apply and reverse would replace by regular "
            f"files (they write by rename); nothing changed:\n  "
            + "\n  ".join(f"{target.show(p)} -> {dest}" for p, dest in links)
            + "\nrun the script on the tree that holds the real files, or replace each link by a copy "
              "(cp --remove-destination \"$(readlink -f LINK)\" LINK)")
    if survey.missing:
        raise SeriesError(
            f"{', '.join(target.show(p) for p in survey.missing)} missing from {target.root} (a tool stopped "
            f"part-way can delete files): {restore_hint(target, survey.missing)}; nothing changed")
    if survey.conflicts:
        lines = "\n  ".join(f"{target.show(f.path)}: {f.conflict}" for f in survey.conflicts)
        raise SeriesError(
            f"files the series touches hold neither SGLang {EXPECTED_VERSION}'s text nor that text with some "
            f"of the series' hunks; nothing changed:\n  {lines}\nif they hold edits of your own, keep a copy "
            f"and {restore_hint(target, [f.path for f in survey.conflicts])}{series_note()}")
    if survey.local_edits and not force:
        keep = "apply the series over them" if verb == "apply" else "take the series out and keep them"
        raise SeriesError(
            f"local edits in files the series touches (they differ from SGLang {EXPECTED_VERSION} outside "
            f"the series' hunks; pass {force_hint()} to {keep}){series_note()}; nothing changed:\n  "
            + "\n  ".join(target.show(p) for p in survey.local_edits))


def fail(message: str, code: int = 1):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def run_verb(main) -> None:
    """Run a verb's main(); a SeriesError becomes 'error: ...' and its exit code. Ctrl-C
    outside a swap (the swap holds it: scripts/_journal.py) comes before anything is
    written: it says so and exits 130."""
    try:
        sys.exit(main())
    except SeriesError as exc:
        fail(str(exc), exc.code)
    except KeyboardInterrupt:
        fail("interrupted (Ctrl-C) before anything was written; nothing changed", 130)
    except PermissionError as exc:  # reading the tree (a write's are caught where it writes)
        fail(f"{exc}; nothing changed: run as a user who can read and write the tree")
