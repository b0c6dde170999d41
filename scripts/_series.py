"""What the series scripts share: the pin, the series, the target tree, its record, the swap.

Patches are git format-patch output whose index lines name each file's blob before and after;
git apply, outside any repository and configuration, writes the bytes. The record,
PACKAGE/.sglang-series/ (written by apply, read by Survey), the all-or-none swap (transact,
recover) and the lock every verb takes: docs/contributing.md, "How the scripts change a tree".
"""
from __future__ import annotations

import argparse, contextlib, csv, errno, fcntl, hashlib, json, os, re, shutil, signal, subprocess, sys  # noqa: E401
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "patches"
SERIES_FILE = PATCH_DIR / "series"
SUMS_FILE = "series.sha256"
PACKAGE = "python/sglang/"  # every patched path starts so: git apply -p3 strips a/python/sglang/
RECORD = ".sglang-series"
LEFTOVERS = (".orig", ".rej")
KEPT = ".sglang-series-old"  # a file's bytes before a stopped change, where the file changed since
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class SeriesError(Exception):
    """A condition the user must fix; the message says what and how."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def fail(message: str, code: int = 1):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


class Parser(argparse.ArgumentParser):
    """A script's arguments, its docstring the help; a usage error is one 'error:' line and exit 1."""

    def __init__(self, doc: str):
        super().__init__(prog=f"scripts/{Path(sys.argv[0]).name}", description=doc,
                         formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message: str):
        fail(f"{message} ({self.prog} --help says how to run it)")


def cli(main, *args, interrupted: str = "interrupted (Ctrl-C)") -> None:
    """Run a script's main(): a SeriesError, an OSError or Ctrl-C becomes one 'error: ...' line."""
    sys.stdout.reconfigure(errors="backslashreplace")  # a path that is not UTF-8, under a strict encoding
    try:
        sys.exit(main(*args))
    except SeriesError as exc:
        fail(str(exc), exc.code)
    except KeyboardInterrupt:
        fail(interrupted, 130)
    except OSError as exc:
        fail(f"{exc}; nothing changed" + ("; run as a user who can read and write the tree"
                                          if isinstance(exc, PermissionError) else ""))


def read_pin(path: Path = ROOT / "sglang.pin") -> tuple[str, str]:
    """sglang.pin's version and commit: KEY=value lines, no quotes or spaces (make includes the same
    file). Every script imports this module first: a bad pin is one 'error:' line, not a traceback."""
    if not path.is_file():
        fail(f"{path} is missing: it pins the SGLang release the series is for")
    pin = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            if not (match := re.fullmatch(r"([A-Z_]+)=([^\s\"']+)", line)):
                fail(f"{path}:{number}: expected KEY=value without quotes or spaces")
            pin[match[1]] = match[2]
    if missing := [key for key in ("SGLANG_VERSION", "SGLANG_COMMIT") if key not in pin]:
        fail(f"{path} does not set {missing[0]}")
    return pin["SGLANG_VERSION"], pin["SGLANG_COMMIT"]


EXPECTED_VERSION, UPSTREAM_COMMIT = read_pin()


def run_script(name: str, *args, check: bool = False) -> subprocess.CompletedProcess:
    """Another of these scripts, run with this Python, its output captured; with ``check``, one 'error:'
    line and exit 1 when it fails (build-pristine has no cli())."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)], capture_output=True,
                          text=True)
    if check and proc.returncode != 0:
        fail(f"scripts/{name} failed: {proc.stderr.strip()}")
    return proc


def read_series(patches: Path = PATCH_DIR) -> list[Path]:
    """The patches patches/series lists, which must be the patches patches/ holds, numbered in order as
    export-patches writes them: an edit of either is named here (no git needed: the image has none)."""
    if not (patches / "series").is_file():
        raise SeriesError(f"{patches / 'series'} is missing")
    listed = [line.strip() for line in (patches / "series").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
    held = sorted(p.name for p in patches.glob("*.patch"))
    unlisted, absent = [n for n in held if n not in listed], [n for n in listed if n not in held]
    misplaced = [f"{n} as patch {i}" for i, n in enumerate(listed, 1) if not n.startswith(f"{i:04d}-")]
    if unlisted or absent or misplaced:
        wrong = (f"does not list {', '.join(unlisted)}" if unlisted else
                 f"lists {', '.join(absent)}, not in {patches}" if absent else f"lists {', '.join(misplaced)}")
        raise SeriesError(f"{patches / 'series'} {wrong}: it must list each patch there once, in their numbered "
                          "order, as scripts/export-patches writes it (git checkout -- patches/ restores a checkout's)")
    check_sums(patches, listed)
    return [patches / name for name in listed]


def sums_text(patches: Path, names: list[str]) -> str:
    """`sha256sum series PATCH...` in patches/: what export-patches writes to series.sha256 (its
    sha256 is the series' digest)."""
    return "".join(f"{sha((patches / n).read_bytes())}  {n}\n" for n in ["series", *names])


def check_sums(patches: Path, listed: list[str]) -> None:
    """The series is the one export-patches wrote: series.sha256 names every file and its sha256
    (`cd patches && sha256sum -c series.sha256`), so a patch dropped and the rest renumbered,
    an edited patch or an emptied series is refused, named, before anything is applied."""
    sums = patches / SUMS_FILE
    if not sums.is_file():
        raise SeriesError(f"{sums} is missing: scripts/export-patches writes it with the series "
                          "(git checkout -- patches/ restores a checkout's)")
    expected = {}
    for number, line in enumerate(sums.read_text(errors="replace").splitlines(), 1):
        if not (match := re.fullmatch(r"([0-9a-f]{64})  (\S+)", line)):
            raise SeriesError(f"{sums}:{number}: not a line of sha256sum (HASH, two spaces, a file name)")
        expected[match[2]] = match[1]
    names = ["series", *listed]
    changed = [n for n in names if n in expected and expected[n] != sha((patches / n).read_bytes())]
    added, dropped = [n for n in names if n not in expected], [n for n in expected if n not in names]
    if changed or added or dropped:
        what = "; ".join(part for part in (
            f"{', '.join(changed)} changed" if changed else "", f"{', '.join(added)} not in it" if added else "",
            f"{', '.join(dropped)} dropped" if dropped else "") if part)
        raise SeriesError(f"{patches / 'series'} is not the series export-patches wrote ({SUMS_FILE}: {what}); "
                          "change the series in the work folder and export it (docs/contributing.md), or "
                          "git checkout -- patches/ restores a checkout's")


def patch_name(number: int, subject: str) -> str:
    """NNNN-slug.patch: the subject's words joined by '-', cut at a word boundary to at most
    60 characters, not ending on a word such as 'a' or 'by'."""
    words, kept = [w for w in re.split(r"[^A-Za-z0-9_.]+", subject) if w.strip(".")], []
    for word in words:
        if len("-".join(kept + [word])) > 60:
            while len(kept) > 1 and kept[-1].lower() in "a an and at by for from in of on or the to with".split():
                kept.pop()
            break
        kept.append(word)
    return f"{number:04d}-{'-'.join(kept) or (words[0][:60] if words else 'patch')}.patch"


# git rev-parse --local-env-vars: set in the caller's environment (a git hook, a shell in another
# repository), they would point every command here at that repository instead of ``folder``
LOCAL_GIT_VARS = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY",
                  "GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_IMPLICIT_WORK_TREE", "GIT_PREFIX", "GIT_SHALLOW_FILE",
                  "GIT_GRAFT_FILE", "GIT_NAMESPACE")


def git(folder: Path, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in (env or os.environ).items() if k not in LOCAL_GIT_VARS}
    proc = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise SeriesError(f"git {' '.join(args)} in {folder} failed: {proc.stderr.strip()}")
    return proc


def work_git(option: str | None):
    """import/export-patches' work folder (--work, $SERIES_WORK, build/work) and a git runner in it."""
    work = Path(option or os.environ.get("SERIES_WORK") or ROOT / "build" / "work").resolve()
    env = {"GIT_COMMITTER_NAME": "series import", "GIT_COMMITTER_EMAIL": "series-import@localhost", **os.environ}
    return work, lambda *args, check=True: git(work, *args, check=check, env=env)  # the committer: git am's


def tagged(run, name: str) -> bool:
    return bool(run("rev-parse", "-q", "--verify", f"refs/tags/{name}", check=False).stdout.strip())


def mark(run, tag: str, patches: Path = PATCH_DIR) -> None:
    """Tag HEAD (series-base at the import, series-exported once the work folder and patches/ agree)
    with what patches/ holds now: export-patches then sees a patches/ changed since (a pull, an
    edit) that an export from this work folder would undo."""
    run("tag", "-f", "-a", "-m", f"patches/ sha256 {patches_digest(patches)}", tag, "HEAD")


def recorded_digest(run) -> str | None:
    """What patches/ held when the work folder last agreed with it (series-exported, else the import's
    series-base); None for a work folder tagged before the digest was recorded: unknown."""
    tag = "series-exported" if tagged(run, "series-exported") else "series-base"
    found = re.search(r"patches/ sha256 (\w+)", run("tag", "-l", "--format=%(contents)", tag).stdout)
    return found[1] if found else None


def patches_digest(patches: Path = PATCH_DIR) -> str:
    files = sorted(p for p in patches.iterdir() if p.name == "series" or re.fullmatch(r"\d{4}-.*\.patch", p.name))
    return sha(b"".join(p.name.encode() + b"\0" + sha(p.read_bytes()).encode() + b"\n" for p in files))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Section:
    """One file's part of one patch; ``index``: how many of the series' sections for that file come before."""
    patch: str
    rel: str  # the path inside the sglang package
    old: str  # blob ids before and after (possibly abbreviated)
    new: str
    text: bytes
    index: int


class Series:
    """The patches patches/series lists, split into one section per file, in order."""

    def __init__(self, patches: Path = PATCH_DIR):
        self.patches, self.sections, self.by_file = [], [], {}
        for path in read_series(patches):
            self.patches.append(path.name)
            sections = re.split(rb"^(?=diff --git )", path.read_bytes(), flags=re.M)[1:]  # [0]: the message
            if not sections:
                raise SeriesError(f"{path.name}: no 'diff --git' section")
            for text in sections:
                self._add(path.name, text)
        # The digest (the record's, the reports'): the sha256 of `sha256sum series PATCH...` in patches/.
        self.files, self.digest = list(self.by_file), sha(sums_text(patches, self.patches).encode())

    def _add(self, patch: str, text: bytes) -> None:
        head = text.split(b"\n@@", 1)[0].decode(errors="replace")
        path = re.match(r"diff --git a/(\S+) b/(\S+)\n", head)
        index = re.search(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)", head, re.M)
        if not path or path[1] != path[2] or not path[1].startswith(PACKAGE) or not index or re.search(
                r"^(new file|deleted file|old mode|new mode|rename from|copy from|Binary|GIT binary)", head, re.M):
            raise SeriesError(f"{patch}: '{head.splitlines()[0]}': only changes to existing text files under "
                              f"{PACKAGE}, with index lines, are supported")
        earlier = self.by_file.setdefault(path[1][len(PACKAGE):], [])
        if earlier and not (earlier[-1].new.startswith(index[1]) or index[1].startswith(earlier[-1].new)):
            raise SeriesError(f"{SERIES_FILE}: {patch} changes {path[1]} as {earlier[-1].patch} does not leave it "
                              f"(blob {index[1]}, not {earlier[-1].new}): a patch is missing, added or out of order")
        earlier.append(Section(patch, path[1][len(PACKAGE):], index[1], index[2], text, len(earlier)))
        self.sections.append(earlier[-1])


def git_apply(files: dict[str, bytes], sections: list[Section], reverse: bool = False) -> dict[str, bytes] | None:
    """``files`` with ``sections`` applied (reverse: undone) by git apply in a scratch folder, outside
    any repository and configuration; None where they do not apply. One git apply per layer (each
    file's first section, then its second...): git apply -R does not chain one file's patches."""
    if not sections:
        return dict(files)
    if not shutil.which("git"):
        raise SeriesError("git is missing: these scripts write the patched files with git apply; install git")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    with tempfile.TemporaryDirectory(prefix="sglang-series-") as tmp:
        env.update(GIT_CEILING_DIRECTORIES=str(Path(tmp).parent), GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull)
        for rel, data in files.items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / rel).write_bytes(data)
        for layer in sorted({s.index for s in sections}, reverse=reverse):
            if subprocess.run(["git", "-c", f"core.attributesFile={os.devnull}", "apply", "-p3", "--whitespace=nowarn",
                               *(["-R"] if reverse else [])], cwd=tmp, env=env, capture_output=True,
                              input=b"".join(s.text for s in sections if s.index == layer)).returncode != 0:
                return None
        return {rel: (Path(tmp) / rel).read_bytes() for rel in files}


@dataclass(frozen=True)
class Target:
    root: Path
    layout: str  # "checkout" (root/python/sglang) or "installed" (root/sglang)

    @property
    def package_dir(self) -> Path:
        return self.root / ("python/sglang" if self.layout == "checkout" else "sglang")

    def show(self, *rels: str, sep: str = ", ") -> str:
        """Files as the user knows them: relative to the folder they named."""
        return sep.join(str((self.package_dir / rel).relative_to(self.root)) for rel in rels)


def find_target(path: str) -> Target:
    kinds = ("name an upstream checkout (holding python/sglang/), an installed SGLang's folder (holding sglang/) "
             "or the sglang package folder itself")
    root = Path(path).resolve()
    if not str(path).strip() or (root.exists() and not root.is_dir()):
        raise SeriesError(f"{path!r} is {'a file' if str(path).strip() else 'an empty path'}, not a folder; {kinds}")
    if not root.is_dir():
        raise SeriesError(f"{path}: no such directory")
    checkout, installed = (root / "python/sglang/__init__.py").is_file(), (root / "sglang/__init__.py").is_file()
    if checkout and installed:
        raise SeriesError(f"{path} holds two SGLang packages, {root / 'python/sglang'} (an upstream checkout) and "
                          f"{root / 'sglang'} (an installed package); which one Python imports depends on its path, so "
                          "name the package folder you mean (scripts/install-into-python --python PY finds PY's)")
    if checkout or installed:
        return Target(root, "checkout" if checkout else "installed")
    if root.name == "sglang" and (root / "__init__.py").is_file() and (root / "srt").is_dir():
        return Target(root.parent, "installed")
    raise SeriesError(f"{path} is not an SGLang tree: {kinds}")


def check_version(target: Target) -> str:
    """The version from sglang/_version.py, else the dist-info owning sglang/, else the git commit."""
    version_file = target.package_dir / "_version.py"
    found = re.search(r"^__version__\s*=.*?['\"]([^'\"]+)['\"]", version_file.read_text(), re.M) \
        if version_file.is_file() else None
    infos = sorted(p for p in target.root.glob("*.dist-info") if p.name.lower().startswith("sglang-") and
                   (p / "RECORD").is_file() and ["sglang/__init__.py"] in
                   [row[:1] for row in csv.reader((p / "RECORD").read_text().splitlines())])
    if not found and len(infos) > 1:
        raise SeriesError(f"{target.root} holds {len(infos)} dist-info folders that each claim sglang/ "
                          f"({', '.join(p.name for p in infos)}); remove the stale one(s) "
                          "(pip install --force-reinstall --no-deps sglang==VERSION rewrites the right one)")
    if not found and infos and (infos[0] / "METADATA").is_file():
        found = re.search(r"^Version: (\S+)", (infos[0] / "METADATA").read_text(errors="replace"), re.M)
    head = "" if found else git(target.package_dir, "rev-parse", "HEAD", check=False).stdout.strip()
    version = found[1] if found else EXPECTED_VERSION if head == UPSTREAM_COMMIT else f"unknown (git commit {head})"
    if not found and not head:
        raise SeriesError(f"cannot tell the SGLang version of {target.package_dir}: no _version.py, no dist-info "
                          "and no git commit")
    if version.split("+", 1)[0] != EXPECTED_VERSION:
        raise SeriesError(f"wrong SGLang version in {target.package_dir}: expected {EXPECTED_VERSION}, found {version}")
    return version


@dataclass
class File:
    """A file the series (or the record) touches, as the tree holds it."""
    data: bytes | None = None
    base: bytes | None = None  # the file without the series: SGLang's bytes, or the user's edits of them
    held: int | None = None  # how many of the series' sections for it are in (None: not known)
    edited: bool = False
    problem: str = ""  # missing, conflicting, symbolic link: ...


class Survey:
    """What a tree holds of the series. A file the record (quilt's .pc/) does not vouch for is read from
    its bytes: a blob the index lines name holds exactly the first K of its patches; other bytes are
    local edits over the series (git apply -R applies) or under it (git apply applies), or conflict."""

    def __init__(self, target: Target, series: Series):
        pkg, self.target, self.files, self.record = target.package_dir, target, {}, None
        try:
            if (pkg / RECORD).exists():
                self.record = json.loads((pkg / RECORD / "record.json").read_text())
                record = self.record  # its shape, before anything is read from it or written after it
                assert isinstance(record["digest"], str) and isinstance(record["patches"], list)
                assert isinstance(record["files"], dict) and all(
                    isinstance(entry, dict) and all(isinstance(entry.get(key), str) for key in ("pristine", "written"))
                    for entry in record["files"].values())
        except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
            raise SeriesError(f"{pkg / RECORD} is unreadable ({exc}): not written by these scripts, or by a newer "
                              "version; remove it only if the tree's files are SGLang's own")
        recorded, vouched = self.record["files"] if self.record else {}, []
        for rel in dict.fromkeys(series.files + list(recorded)):
            f = self.files[rel] = File()
            path, sections, kept = pkg / rel, series.by_file.get(rel, []), pkg / RECORD / "pristine" / rel
            if path.is_symlink() or not path.is_file():
                f.problem = (f"symbolic link: {target.show(rel)} -> {os.readlink(path)}" if path.is_symlink()
                             else "missing")
                continue
            f.data = path.read_bytes()
            if rel in recorded and sha(f.data) == recorded[rel]["written"] and kept.is_file() \
                    and sha(kept.read_bytes()) == recorded[rel]["pristine"]:
                f.base, f.held = kept.read_bytes(), len(sections)
                f.edited = bool(sections) and not blob(f.base).startswith(sections[0].old)  # forced over edits
                vouched.append(rel)
                continue
            if not sections and sha(f.data) == recorded[rel]["pristine"]:  # only a stale record's: as it was
                f.base, f.held = f.data, 0
                continue
            blobs = [s.old for s in sections[:1]] + [s.new for s in sections]
            f.held = next((k for k in range(len(blobs) - 1, -1, -1) if blob(f.data).startswith(blobs[k])), None)
            if f.held is not None:  # the blob after K sections: undone, it must be the blob SGLang's file has
                undone = git_apply({rel: f.data}, sections[:f.held], reverse=True)
                f.base = undone[rel] if undone and blob(undone[rel]).startswith(blobs[0]) else None
            elif sections and (undone := git_apply({rel: f.data}, sections, reverse=True)) is not None:
                f.base, f.held, f.edited = undone[rel], len(sections), True
            elif sections and git_apply({rel: f.data}, sections) is not None:
                f.base, f.held, f.edited = f.data, 0, True
            if f.base is None:  # no SGLang bytes under it
                f.problem, f.held = "conflicting", None
        # from another patches/, and holding what it wrote (else stale: e.g. SGLang reinstalled since; the bytes tell)
        self.outdated = bool(vouched) and self.record["digest"] != series.digest
        self.patches = []  # (patch, state, detail): applied, not applied, partly applied, conflicting; none if outdated
        for name in [] if self.outdated else series.patches:
            mine = [s for s in series.sections if s.patch == name]
            held = sum(self.files[s.rel].held is not None and s.index < self.files[s.rel].held for s in mine)
            self.patches.append(
                (name, "conflicting", target.show(*{s.rel for s in mine if self.files[s.rel].problem}))
                if any(self.files[s.rel].held is None for s in mine) else
                (name, "applied" if held == len(mine) else "partly applied" if held else "not applied",
                 f"in {held} of {len(mine)} files" if 0 < held < len(mine) else ""))
        self.present = [name for name, state, _ in self.patches if state != "not applied"]  # wholly or in part
        states = {state for _, state, _ in self.patches}
        self.state = ("outdated" if self.outdated else "conflicting" if "conflicting" in states else
                      "applied" if states == {"applied"} else "pristine" if states == {"not applied"} else "partial")

    def having(self, problem: str) -> list[str]:
        return [rel for rel, f in self.files.items() if f.problem.startswith(problem)]

    def edits(self) -> list[str]:
        return [rel for rel, f in self.files.items() if f.edited]

    def foreign(self) -> list[Path]:
        """What patch tools (.orig, .rej) and a rolled-back change (KEPT) left beside the series' files."""
        near = [self.target.package_dir / (rel + end) for rel in self.files for end in LEFTOVERS + (KEPT,)]
        return [p for p in near if p.exists()]

    def refuse_unsafe(self, verb: str, force: bool) -> None:
        """Stop before writing unless each file is SGLang's, the series' or (forced) edits of them."""
        links, bad = self.having("symbolic link"), self.having("missing") or self.having("conflicting")
        if links:
            raise SeriesError("files the series changes are symbolic links, which apply and reverse would replace by "
                              f"regular files: {'; '.join(self.files[r].problem[15:] for r in links)}; nothing changed "
                              "(run on the tree that holds the real files, or replace each link by a copy: "
                              "cp --remove-destination \"$(readlink -f LINK)\" LINK)")
        if bad:
            why = (f"missing from {self.target.root}" if self.having("missing") else f"hold neither SGLang "
                   f"{EXPECTED_VERSION}'s bytes, nor the series' over them, nor what these scripts wrote")
            raise SeriesError(f"{self.target.show(*bad)} {why}; nothing changed: keep a copy of any edits of your own, "
                              f"then {restore_hint(self.target, bad)}")
        if self.edits() and not force:
            keep = "apply the series over them" if verb == "apply" else "take the series out and keep them"
            raise SeriesError(f"local edits in files the series touches (they differ from SGLang {EXPECTED_VERSION} "
                              f"outside the series' changes): {self.target.show(*self.edits())}; pass "
                              f"{os.environ.get('SERIES_FORCE_HINT') or '--force'} to {keep}; "
                              "nothing changed")


def restore_hint(target: Target, rels: list[str]) -> str:
    shown = target.show(*rels, sep=" ")
    return (f"restore {shown} from SGLang {EXPECTED_VERSION} (in a git checkout: git -C {target.root} checkout -- "
            f"{shown}; installed: pip install --force-reinstall --no-deps sglang=={EXPECTED_VERSION})")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes, like: os.stat_result | None = None) -> None:
    """A new file, flushed, with the mode and (as root) the owner of ``like``."""
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True)
    with open(path, "xb") as handle:
        handle.write(data)
        if like:
            os.fchmod(handle.fileno(), like.st_mode & 0o7777)
            if os.geteuid() == 0:
                os.fchown(handle.fileno(), like.st_uid, like.st_gid)
        handle.flush()
        os.fsync(handle.fileno())


def drop_bytecode(path: Path) -> None:
    """Remove a .py file's bytecode (any interpreter, any level): no .pyc stands for its old bytes."""
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc") if path.suffix == ".py" else []:
        pyc.unlink(missing_ok=True)


def recover(pkg: Path) -> str | None:
    """Finish what a stopped change left, ignoring Ctrl-C meanwhile; says what it did: a .swap is rolled
    back from its old/, a .done (past the commit) finished. (A folder without its meta.json had only its
    removal left.)"""
    tmp, swap, done, record = (pkg / (RECORD + s) for s in (".tmp", ".swap", ".done", ""))
    if not (tmp.exists() or swap.exists() or done.exists()):
        return None
    before, notes = {signum: signal.signal(signum, signal.SIG_IGN) for signum in SIGNALS}, []
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        for folder in (swap, done):
            meta = json.loads((folder / "meta.json").read_text()) if (folder / "meta.json").exists() else None
            for rel, entry in meta["files"].items() if folder == swap and meta else []:
                path, old = pkg / rel, swap / "old" / rel
                current = sha(path.read_bytes()) if path.is_file() else None
                if current != entry["old"] and old.exists():
                    if current not in (entry["new"], None):  # changed since the stop: left, its old bytes beside it
                        path = path.with_name(path.name + KEPT)
                        notes.append(f"{pkg / rel} changed since; its bytes before the {meta['verb']} are in {path}")
                    os.replace(old, path)
                    drop_bytecode(path)
            if folder == done and meta:
                if record.exists() and ((done / "record").exists() or meta["verb"] == "reverse"):
                    os.replace(record, done / "old-record")
                if (done / "record").exists():
                    os.replace(done / "record", record)
                _fsync(pkg)
            if folder.exists():
                shutil.rmtree(folder)
                verb = meta["verb"] if meta else "change"
                return (f"rolled back an interrupted {verb}: {'; '.join(notes) or 'every file is as it was'}"
                        if folder == swap else f"finished an interrupted {verb} (every file had been swapped in)")
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def transact(pkg: Path, verb: str, changes: dict[str, bytes], record: dict[str, bytes] | None) -> None:
    """Write ``changes`` and the record's files (None: the record removed), {path: new bytes}, all or none:
    staged in .tmp, renamed .swap, the new files renamed into place, .swap renamed .done (the commit)."""
    tmp, swap, done = (pkg / (RECORD + s) for s in (".tmp", ".swap", ".done"))
    try:
        meta = {"verb": verb, "files": {}}
        for rel, new in changes.items():
            old, like = (pkg / rel).read_bytes(), (pkg / rel).stat()
            _write(tmp / "old" / rel, old, like)
            _write(tmp / "new" / rel, new, like)
            meta["files"][rel] = {"old": sha(old), "new": sha(new)}
        for rel, data in (record or {}).items():
            _write(tmp / "record" / rel, data)
        mode = pkg.stat().st_mode & 0o777  # the record: as readable as the package, whatever the umask
        for path in [tmp / "record", *(tmp / "record").rglob("*")] if record else []:
            path.chmod(mode if path.is_dir() else mode & 0o666)
        _write(tmp / "meta.json", json.dumps(meta).encode())
        os.rename(tmp, swap)
        _fsync(pkg)
        for rel in changes:
            drop_bytecode(pkg / rel)
            os.replace(swap / "new" / rel, pkg / rel)
        for folder in {(pkg / rel).parent for rel in changes}:
            _fsync(folder)
        os.rename(swap, done)  # the commit: a signal from here on would only hide that the change went through
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        _fsync(pkg)
    except BaseException as exc:
        code = exc.code if isinstance(exc, SeriesError) else 1  # a SeriesError here is a signal (_stop)
        why = signal.Signals(code - 128).name if code > 128 else str(exc)
        try:
            note = recover(pkg) or ""
        except OSError as again:
            raise SeriesError(f"{verb} stopped ({why}) and undoing it failed too ({again}); the next apply, reverse "
                              "or status finishes or undoes it", code) from exc
        if note.startswith("finished"):
            raise SeriesError(f"{why} during the swap: the {verb} went through", code) from exc
        hint = f"; run as a user who can write {pkg}" if isinstance(exc, PermissionError) else ""
        raise SeriesError(f"{verb} stopped ({why}); every file is as it was; nothing changed{hint}", code) from exc
    try:
        recover(pkg)
    except OSError as exc:
        print(f"note: the {verb} went through, but removing {done} failed ({exc}); the next apply, reverse or status "
              "removes it", file=sys.stderr)


@contextlib.contextmanager
def opened(path: str):
    """Every verb's start: the tree, its lock, a stopped change finished, the version, the survey."""
    target = find_target(path)
    fd = os.open(target.package_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SeriesError(f"another apply, reverse or status is working on {target.package_dir}; wait for it")
        try:
            note = recover(target.package_dir)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            raise SeriesError(f"an apply or reverse was cut short in {target.package_dir}; finishing it needs write "
                              f"access ({exc}): run this as its owner or root")
        if note:
            print(f"note: {target.package_dir}: {note}", file=sys.stderr)
        version, series = check_version(target), Series()
        found = Survey(target, series)
        left = [str(p.relative_to(target.root)) for p in found.foreign() if p.name.endswith(LEFTOVERS)]
        if left:
            print(f"note: left by a patch tool, not part of SGLang, and kept: {', '.join(left)} (remove them when "
                  "done with them)", file=sys.stderr)
        yield target, version, series, found
    finally:
        os.close(fd)


def apply(path: str, force: bool) -> int:
    with opened(path) as (target, version, series, found):
        if found.state == "applied":
            print(f"series already applied to {target.package_dir} ({len(series.patches)} patches); nothing changed")
            return 0
        found.refuse_unsafe("apply", force)
        bases = {rel: f.base for rel, f in found.files.items()}
        new = git_apply({rel: bases[rel] for rel in series.files}, series.sections)
        wrong = [rel for rel in series.files if new and not found.files[rel].edited
                 and not blob(new[rel]).startswith(series.by_file[rel][-1].new)]
        if new is None or wrong:
            what = f"gave {target.show(*wrong)} other bytes than the index lines name" if new else "refused the series"
            raise SeriesError(f"git apply {what} over {target.package_dir}'s files without it; nothing changed")
        record = {"digest": series.digest, "patches": series.patches,
                  "files": {rel: {"pristine": sha(bases[rel]), "written": sha(new[rel])} for rel in series.files}}
        record = {"record.json": json.dumps(record, indent=1).encode(),
                  **{f"pristine/{rel}": bases[rel] for rel in series.files}}
        new = {**bases, **new}  # a file only an older series changed goes back to its recorded bytes
        transact(target.package_dir, "apply", {rel: data for rel, data in new.items() if data != found.files[rel].data},
                 record)
    print(f"applied {len(series.patches)} patches to {target.package_dir} (SGLang {version}, {target.layout} layout)")
    print("".join(f"  already in before: {name}\n" for name in found.present), end="")
    return 0


def reverse(path: str, force: bool) -> int:
    with opened(path) as (target, version, series, found):
        if found.state == "pristine" and not found.record:
            print(f"series is not applied to {target.package_dir}; nothing changed")
            return 0
        found.refuse_unsafe("reverse", force)
        transact(target.package_dir, "reverse", {rel: f.base for rel, f in found.files.items() if f.base != f.data},
                 None)
    undone = found.record["patches"] if found.outdated else found.present
    print(f"reversed {len(undone)} patches in {target.package_dir}" + "".join(f"\n  {name}" for name in undone))
    return 0


def status(path: str) -> int:
    with opened(path) as (target, version, series, found):
        pass
    print(f"SGLang {version} at {target.package_dir} ({target.layout} layout): series {found.state}")
    if found.outdated:
        print(f"  applied by scripts/apply from another patches/ (digest {found.record['digest'][:12]}, "
              f"{len(found.record['patches'])} patches): scripts/apply replaces it, scripts/reverse takes it out")
    marks = {"applied": "x", "not applied": " ", "partly applied": "~", "conflicting": "!"}
    for name, state, detail in found.patches:
        print(f"  [{marks[state]}] {name}: {state}" + (f" ({detail})" if detail else ""))
    for what in ("missing", "conflicting"):
        if found.having(what):
            print(f"{what}: {target.show(*found.having(what))}: {restore_hint(target, found.having(what))}")
    if found.edits():
        print(f"local edits (outside the series' changes): {target.show(*found.edits())}")
    for rel in found.having("symbolic link"):
        print(f"{found.files[rel].problem} (apply and reverse refuse it: they write by rename)")
    for leftover in found.foreign():
        why = "a file's bytes before a rolled-back change" if leftover.name.endswith(KEPT) else "left by a patch tool"
        print(f"foreign: {leftover.relative_to(target.root)} ({why}; not part of SGLang)")
    return 0 if found.state == "applied" else 3


def _stop(signum, frame):  # a verb's SIGINT, SIGTERM, SIGHUP: one line, exit 128+N (transact says what it undid)
    for each in SIGNALS:  # once: another cannot cut short the rollback this one starts
        signal.signal(each, signal.SIG_IGN)
    raise SeriesError(f"interrupted ({signal.Signals(signum).name}) before anything was written; nothing changed",
                      128 + signum)


def main(verb: str, doc: str) -> None:
    """A verb's command line (scripts/apply, reverse, status); its wrapper catches a Ctrl-C before this."""
    def run() -> int:
        for signum in SIGNALS:
            signal.signal(signum, _stop)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `scripts/status X | head` is not an error
        parser = Parser(doc)
        parser.add_argument("target", help="SGLang checkout, folder holding an installed sglang/, or sglang/ itself")
        if verb != "status":
            parser.add_argument("--force", action="store_true", help="over local edits (they are kept)")
        args = parser.parse_args()
        return globals()[verb](args.target, *([] if verb == "status" else [args.force]))
    cli(run)
