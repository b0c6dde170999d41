"""scripts/apply, reverse and status: every state a tree can be in, and bad input.

The real series is applied and reversed in both layouts against the oracle (git apply of the
patch files); the states are made over the synthetic series of tests/support/series_trees.py.
The decision is the sha256 listing of the whole tree. Faults are in test_series_faults.py.
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.series_trees import (FAKE_PATCHES, LAYOUTS, REAL, RECORD, digest, fake, git,  # noqa: F401
                                        git_apply, needs_pristine, package, relock, synthetic)


def first_line(proc) -> str:
    return (proc.stdout.splitlines() or [""])[0]


def marks(status) -> list[str]:
    """status's mark for each patch: '  [x]', '  [ ]'..."""
    return [line.split("]")[0] + "]" for line in status.stdout.splitlines()[1:]]


def refused(proc, *words: str) -> None:
    """Exit 1 and one line of stderr that holds each of ``words``."""
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, (proc.stdout, proc.stderr)
    assert all(word in proc.stderr for word in words), proc.stderr


@needs_pristine
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_real_series_applies_as_git_apply_does_and_reverses_to_every_byte(tmp_path, layout):
    tree = REAL.tree(tmp_path / "tree", layout)
    oracle = digest(REAL.tree(tmp_path / "oracle", layout, patched=True))
    before = digest(tree)
    applied = REAL.run("apply", tree)
    assert applied.returncode == 0 and len(applied.stdout.splitlines()) == 1, applied.stderr
    assert digest(tree, record=False) == oracle and digest(tree) != oracle  # the same bytes, and a record
    status = REAL.run("status", tree)
    assert status.returncode == 0 and first_line(status).endswith(": series applied")
    assert [line.split()[0] for line in status.stdout.splitlines()[1:]] == ["[x]"] * len(REAL.patches)
    assert "already applied" in REAL.run("apply", tree).stdout and digest(tree, record=False) == oracle
    reversed_ = REAL.run("reverse", tree)
    assert reversed_.returncode == 0 and max(len(line) for line in reversed_.stdout.splitlines()) < 200
    assert digest(tree) == before  # the record gone too
    assert REAL.run("reverse", tree).stdout.startswith("series is not applied")
    assert REAL.run("status", tree).returncode == 3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("how", ["patch", "git apply"])
def test_a_tree_patched_without_the_scripts_is_read_completed_and_reversed(fake, tmp_path, layout, how):
    """The first patches applied by hand (no record), one count at a time: read, completed, reversed."""
    pristine = fake.tree(tmp_path / "pristine", layout)
    oracle = digest(fake.tree(tmp_path / "oracle", layout, patched=True))
    before = digest(pristine)
    for count in range(len(fake.patches) + 1):
        tree = shutil.copytree(pristine, tmp_path / f"{how}-{count}")
        for patch in fake.patches[:count]:
            if how == "patch":
                subprocess.run(["patch", "-s", "-p1" if layout == "checkout" else "-p2", "-i", str(patch)], cwd=tree,
                               check=True)
            else:
                git_apply(tree, layout, [patch])
        status = fake.run("status", tree)
        state = "pristine" if count == 0 else "applied" if count == len(fake.patches) else "partial"
        assert first_line(status).endswith(f"series {state}"), status.stdout
        assert marks(status) == ["  [x]"] * count + ["  [ ]"] * (len(fake.patches) - count)
        completed = shutil.copytree(tree, tmp_path / f"{how}-{count}-completed")
        assert fake.run("apply", completed).returncode == 0 and digest(completed, record=False) == oracle
        assert fake.run("reverse", tree).returncode == 0 and digest(tree) == before, count
        assert fake.run("reverse", completed).returncode == 0 and digest(completed) == before, count


def test_files_left_half_patched_by_a_stopped_tool_are_read_per_file(fake, tmp_path):
    tree = fake.tree(tmp_path / "tree")
    before = digest(tree)
    git_apply(tree, "installed", fake.patches)
    shutil.copy2(fake.pristine / fake.files[-1], package(tree, "installed") / fake.files[-1])
    status = fake.run("status", tree)
    assert first_line(status).endswith("series partial")
    assert "[~]" in status.stdout and "partly applied (in 2 of 3 files)" in status.stdout
    completed = shutil.copytree(tree, tmp_path / "completed")
    assert fake.run("apply", completed).returncode == 0
    assert digest(completed, record=False) == digest(fake.tree(tmp_path / "oracle", patched=True))
    assert fake.run("reverse", tree).returncode == 0 and digest(tree) == before


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("damage", ["missing", "conflicting"])
def test_a_missing_or_foreign_file_is_named_and_nothing_is_written(fake, tmp_path, layout, damage):
    tree = fake.tree(tmp_path / "tree", layout)
    assert fake.run("apply", tree).returncode == 0
    victim = package(tree, layout) / fake.files[1]
    shown = str(victim.relative_to(tree))
    if damage == "missing":
        victim.unlink()
    else:
        victim.write_text("something else entirely\n")
    before = digest(tree)
    status = fake.run("status", tree)
    assert status.returncode == 3 and first_line(status).endswith("series conflicting")
    assert f"{damage}: {shown}: restore {shown} from SGLang 0.5.20" in status.stdout and "[!]" in status.stdout
    for verb in ("apply", "reverse"):
        proc = fake.run(verb, tree)
        refused(proc, "nothing changed", "pip install --force-reinstall")
        assert proc.stderr.startswith(f"error: {shown} ") and digest(tree) == before


@pytest.mark.parametrize("layout", LAYOUTS)
def test_local_edits_are_refused_unless_forced_and_kept(fake, tmp_path, layout):
    """Edits made before apply and edits made after it: each verb needs --force, and keeps them."""
    tree = fake.tree(tmp_path / "tree", layout)
    edited = package(tree, layout) / fake.files[0]
    edited.write_text("# a local edit\n" + edited.read_text())
    before = digest(tree)
    refused(fake.run("apply", tree), "local edits in files the series touches (they differ",
            f": {edited.relative_to(tree)}; pass --force to apply the series over them")
    assert digest(tree) == before and fake.run("apply", "--force", tree).returncode == 0
    assert edited.read_text().startswith("# a local edit\n") and "return 2 * 1" in edited.read_text()
    status = fake.run("status", tree)
    assert status.returncode == 0
    assert f"local edits (outside the series' changes): {edited.relative_to(tree)}" in status.stdout
    refused(fake.run("reverse", tree), "pass --force to take the series out and keep them")
    assert fake.run("reverse", "--force", tree).returncode == 0 and digest(tree) == before
    # An edit after apply: the record's bytes would lose it; a forced reverse undoes the series around it.
    tree = fake.tree(tmp_path / "after", layout)
    pristine = digest(tree)
    assert fake.run("apply", tree).returncode == 0
    edited = package(tree, layout) / fake.files[0]
    edited.write_text("# on top\n" + edited.read_text())
    assert fake.run("reverse", tree).returncode == 1
    assert fake.run("reverse", "--force", tree).returncode == 0
    assert edited.read_text() == "# on top\n" + (fake.pristine / fake.files[0]).read_text()
    edited.write_text(edited.read_text()[len("# on top\n"):])
    assert digest(tree) == pristine


@pytest.mark.parametrize("reinstalled", [False, True], ids=["outdated", "reinstalled"])
def test_a_tree_applied_from_another_series_is_brought_to_this_one(fake, tmp_path, reinstalled):
    """patches/ changed since the apply: status says outdated, apply goes from the recorded pristine
    bytes to this series, reverse restores. Reinstalled (SGLang's bytes back, the record left), the
    record vouches for no file: the tree reads as pristine."""
    tree = fake.tree(tmp_path / "tree")
    before = digest(tree)
    assert fake.run("apply", tree).returncode == 0
    if reinstalled:  # and the series lost its last patch, the only one to change cache.py
        for rel in fake.files:
            (package(tree, "installed") / rel).unlink()  # a reinstall writes new files
            shutil.copy2(fake.pristine / rel, package(tree, "installed") / rel)
        other = synthetic(tmp_path / "other", FAKE_PATCHES[:-1])
    else:
        other = synthetic(tmp_path / "other", [("one change", {"srt/cache.py": [("CONSTANT_7 = 7\n", "SEVEN = 7\n")]})])
    status = other.run("status", tree)
    assert status.returncode == 3, (status.stdout, status.stderr)
    if reinstalled:
        assert first_line(status).endswith("series pristine") and marks(status) == ["  [ ]"] * len(other.patches)
    else:
        assert first_line(status).endswith("series outdated"), status.stdout
        assert "applied by scripts/apply from another patches/" in status.stdout
    applied = shutil.copytree(tree, tmp_path / "applied")
    assert other.run("apply", applied).returncode == 0
    expected = fake.tree(tmp_path / "expected")  # the files only the older series changed are SGLang's again
    git_apply(expected, "installed", other.patches)
    assert digest(applied, record=False) == digest(expected) and other.run("status", applied).returncode == 0
    assert other.run("reverse", applied).returncode == 0 and digest(applied) == before
    assert other.run("reverse", tree).returncode == 0 and digest(tree) == before


def test_files_a_patch_tool_left_are_named_and_kept(fake, tmp_path):
    tree = fake.tree(tmp_path / "tree")
    target = package(tree, "installed") / fake.files[0]
    for suffix in (".rej", ".orig"):
        target.with_name(target.name + suffix).write_text("left by patch\n")
    shown = str(target.relative_to(tree))
    status = fake.run("status", tree)
    assert f"foreign: {shown}.orig" in status.stdout and f"foreign: {shown}.rej" in status.stdout
    for verb in ("apply", "reverse"):
        proc = fake.run(verb, tree)
        assert proc.returncode == 0 and f"kept: {shown}.orig, {shown}.rej" in proc.stderr
    assert target.with_name(target.name + ".rej").read_text() == "left by patch\n"


def test_a_symlinked_file_is_refused_and_named(fake, tmp_path):
    tree = fake.tree(tmp_path / "tree")
    link = package(tree, "installed") / fake.files[0]
    real = tmp_path / "elsewhere.py"
    shutil.copy2(link, real)
    link.unlink()
    link.symlink_to(real)
    before = digest(tree), real.read_bytes()
    refused(fake.run("apply", tree), "nothing changed", "symbolic links", f"{link.relative_to(tree)} -> {real}")
    assert (digest(tree), real.read_bytes()) == before and link.is_symlink()
    assert f"symbolic link: {link.relative_to(tree)} -> {real}" in fake.run("status", tree).stdout


@pytest.mark.parametrize("bad", ["missing", "not-sglang", "a file", "empty"])
def test_bad_paths_get_one_line(fake, tmp_path, bad):
    (tmp_path / "file").write_text("")
    path = {"missing": tmp_path / "nope", "not-sglang": tmp_path, "a file": tmp_path / "file", "empty": ""}[bad]
    expected = {"missing": "no such directory", "not-sglang": "is not an SGLang tree", "a file": "is a file, not a folder",
                "empty": "'' is an empty path, not a folder"}[bad]
    for verb in ("apply", "status"):
        proc = fake.run(verb, path)
        refused(proc, expected)
        assert proc.stderr.startswith("error: ")


@pytest.mark.parametrize("script", ["apply", "reverse", "status", "install-into-python", "check", "import-patches",
                                    "export-patches", "build-pristine", "fetch-wheel"])
def test_a_usage_error_is_one_line_and_exit_1(fake, tmp_path, script):
    """An unknown option (or a verb without its tree): one 'error:' line and exit 1, not argparse's exit 2."""
    for args in (["--no-such-option", tmp_path], [] if script in ("apply", "reverse", "status") else None):
        if args is not None:
            proc = fake.run(script, *args)
            refused(proc)
            assert proc.stderr.startswith("error: "), proc.stderr
    assert fake.run(script, "--help").returncode == 0


def test_a_tree_path_that_is_not_utf_8_is_printed_under_a_strict_stdout(fake, tmp_path):
    tree = fake.tree(tmp_path / os.fsdecode(b"tree-\xff"))
    strict = {"PYTHONIOENCODING": "utf-8"}
    for verb, code in (("apply", 0), ("status", 0), ("reverse", 0), ("status", 3)):
        proc = fake.run(verb, tree, env=strict)
        assert proc.returncode == code and "Traceback" not in proc.stderr, (verb, proc.stderr)
        assert "tree-" in proc.stdout
    assert digest(tree) == digest(fake.tree(tmp_path / "pristine"))


def test_the_package_folder_itself_is_a_target_and_two_packages_are_refused(fake, tmp_path):
    tree = fake.tree(tmp_path / "tree")
    assert fake.run("apply", package(tree, "installed")).returncode == 0
    assert fake.run("status", tree).returncode == 0
    both = fake.tree(fake.tree(tmp_path / "both", "checkout"), "installed")
    before = digest(both)
    proc = fake.run("apply", both)
    assert proc.returncode == 1 and "holds two SGLang packages" in proc.stderr and digest(both) == before
    assert fake.run("apply", both / "sglang").returncode == 0
    assert fake.run("status", both / "sglang").returncode == 0
    assert fake.run("status", both / "python" / "sglang").returncode == 3


def dist_info(tree: Path, version: str) -> None:
    info = tree / f"sglang-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.4\nName: sglang\nVersion: {version}\n\n")
    (info / "RECORD").write_text("sglang/__init__.py,,\n")


def test_the_version_comes_from_the_package_then_the_dist_info_that_owns_it(fake, tmp_path):
    tree = fake.tree(tmp_path / "site")
    dist_info(tree, "0.5.19")  # left by an interrupted upgrade
    dist_info(tree, "0.5.20")
    assert fake.run("status", tree).returncode == 3  # _version.py says 0.5.20
    version = package(tree, "installed") / "_version.py"
    version.write_text(version.read_text().replace("0.5.20", "0.5.19"))
    before = digest(tree)
    refused(fake.run("apply", tree), "expected 0.5.20, found 0.5.19")  # a wrong version: refused
    assert digest(tree) == before
    version.unlink()
    refused(fake.run("status", tree), "2 dist-info folders that each claim sglang/")
    (tree / "sglang-0.5.19.dist-info" / "RECORD").write_text("other/__init__.py,,\n")
    assert first_line(fake.run("status", tree)).startswith("SGLang 0.5.20 at")


def test_modes_are_kept_and_no_stale_bytecode_outlives_a_change(fake, tmp_path):
    """After apply and after reverse: each file's mode as it was, each changed module's unchecked-hash
    .pyc (which Python never compares with the source) its new source's, other bytecode kept."""
    tree = fake.tree(tmp_path / "tree")
    files = [package(tree, "installed") / rel for rel in fake.files]
    for number, path in enumerate(files):
        path.chmod((0o640, 0o755, 0o600)[number % 3])
    modes = {p: p.stat().st_mode for p in files}
    subprocess.run([sys.executable, "-m", "compileall", "-q", "--invalidation-mode", "unchecked-hash", str(tree)],
                   check=True)
    kept = Path(importlib.util.cache_from_source(str(package(tree, "installed") / "_version.py")))
    for verb in ("apply", "reverse"):
        assert fake.run(verb, tree).returncode == 0
        assert {p: p.stat().st_mode for p in files} == modes, verb
        for module in (p for p in files if p.suffix == ".py"):
            code = importlib.machinery.SourceFileLoader(module.stem, str(module)).get_code(module.stem)
            assert code == compile(module.read_bytes(), str(module), "exec", dont_inherit=True), (verb, module)
    assert kept.exists()


BUILDS_ON = [("pool: one", {"srt/pool.py": [("return 1\n", "return 2 * 1\n")]}),  # patch 3 changes patch 2's change
             ("kernels: first", {"srt/kernels/copy.cuh": [("x + 3;", "x + 3 + 1;")]}),
             ("kernels: builds on the first", {"srt/kernels/copy.cuh": [("x + 3 + 1;", "x + 3 + 2;")]})]


def listed(how, named):
    """patches/series edited by hand to list ``how(names)``: the refusal names the patch ``names[named]``."""
    def edit(patches: Path, names: list[str]) -> list[str]:
        (patches / "series").write_text("".join(f"{n}\n" for n in how(names)))
        return ["patches/series", names[named] if named is not None else "0004-extra"]
    return edit


def dropped(patches: Path, names: list[str]) -> list[str]:  # patch 2's file and line gone: patch 3 listed second
    (patches / "series").write_text(f"{names[0]}\n{names[2]}\n")
    (patches / names[1]).unlink()
    return [names[2]]


def renumbered(patches: Path, names: list[str]) -> list[str]:  # the gap closed: the listing check cannot see it
    (patches / names[1]).unlink()
    moved = "0002" + names[2][4:]
    (patches / names[2]).rename(patches / moved)
    (patches / "series").write_text(f"{names[0]}\n{moved}\n")
    return [moved, names[1], names[2]]


def hunk_edited(patches: Path, names: list[str]) -> list[str]:
    (patches / names[0]).write_text((patches / names[0]).read_text().replace("return 2 * 1", "return 3 * 1"))
    return [names[0], "changed"]


def every_patch_removed(patches: Path, names: list[str]) -> list[str]:
    for name in names:
        (patches / name).unlink()
    (patches / "series").write_text("")
    return [*names, "dropped"]


def sums_removed(patches: Path, names: list[str]) -> list[str]:
    (patches / "series.sha256").unlink()
    return ["series.sha256 is missing"]


DAMAGES = {  # patches/ edited past what export-patches wrote (it numbers the series in order and sums it)
    "last line dropped": listed(lambda n: n[:-1], -1), "middle line dropped": listed(lambda n: n[:1] + n[2:], 1),
    "two swapped": listed(lambda n: [n[1], n[0], *n[2:]], 1), "emptied": listed(lambda n: [], 0),
    "a line twice": listed(lambda n: n + n[-1:], -1), "a file it does not hold": listed(lambda n: [*n, "0004-extra.patch"], None),
    "patch 2 dropped": dropped, "renumbered": renumbered,
    "hunk edited": hunk_edited, "every patch removed": every_patch_removed, "sums removed": sums_removed,
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_an_edited_series_is_refused_and_named_with_or_without_git(tmp_path, damage):
    """Refused in one line that names the series' fault, before anything is written, never blamed on SGLang's
    file or a reinstall; the same refusal in a git checkout of the project and outside one (the image)."""
    fake = synthetic(tmp_path / "series", BUILDS_ON)
    tree, patches, names = fake.tree(tmp_path / "tree"), fake.root / "patches", [p.name for p in fake.patches]
    before, exported = digest(tree), {p.name: p.read_bytes() for p in patches.iterdir()}
    assert fake.run("status", tree).returncode == 3  # sound as exported
    said = {}

    def restore():
        for p in patches.iterdir():
            p.unlink()
        for name, data in exported.items():
            (patches / name).write_bytes(data)

    for checkout in (False, True):
        if checkout:  # the series as exported committed, then damaged again
            restore()
            git(fake.root, "init", "-q")
            git(fake.root, "add", "-A")
            git(fake.root, "commit", "-qm", "x")
        named = DAMAGES[damage](patches, names)
        for verb in ("apply", "status", "reverse"):
            proc = fake.run(verb, tree)
            refused(proc, *named)
            assert "copy.cuh" not in proc.stderr and "force-reinstall" not in proc.stderr, proc.stderr
            said.setdefault(verb, set()).add(proc.stderr)
    assert all(len(messages) == 1 for messages in said.values()), said  # git or not: the same refusal
    assert digest(tree) == before
    restore()
    assert fake.run("apply", tree).returncode == 0  # the refusals left nothing behind


@pytest.mark.parametrize("damage", ["not json", "no patches", "a file's entry not a dict"])
def test_an_unreadable_record_is_named_and_left_alone(fake, tmp_path, damage):
    """Read before anything is written, so a reverse cannot stop halfway on it."""
    tree = fake.tree(tmp_path / "tree")
    assert fake.run("apply", tree).returncode == 0
    record = package(tree, "installed") / RECORD / "record.json"
    data = json.loads(record.read_text())
    data["digest"] = "another series"  # outdated: reverse would undo the record's patches
    if damage == "no patches":
        del data["patches"]
    else:
        data["files"][fake.files[0]] = 1
    record.write_text("not json" if damage == "not json" else json.dumps(data))
    before = digest(tree)
    for verb in ("apply", "reverse", "status"):
        refused(fake.run(verb, tree), "is unreadable")
    assert digest(tree) == before


def test_the_record_says_what_was_applied_and_what_it_replaced_as_readable_as_the_tree(fake, tmp_path):
    """Whatever the umask of the user who applied, its folders and files grant the package folder's read
    permissions (another user who can read a shared site-packages can read it)."""
    tree = fake.tree(tmp_path / "tree")
    pkg = package(tree, "installed")
    pkg.chmod(0o755)
    proc = subprocess.run([sys.executable, str(fake.root / "scripts" / "apply"), str(tree)], capture_output=True,
                          text=True, preexec_fn=lambda: os.umask(0o077))
    assert proc.returncode == 0, proc.stderr
    record = json.loads((pkg / RECORD / "record.json").read_text())
    assert record["patches"] == [p.name for p in fake.patches]
    for rel, entry in record["files"].items():
        assert entry["pristine"] == hashlib.sha256((fake.pristine / rel).read_bytes()).hexdigest()
        assert entry["written"] == hashlib.sha256((pkg / rel).read_bytes()).hexdigest()
        assert (pkg / RECORD / "pristine" / rel).read_bytes() == (fake.pristine / rel).read_bytes()
    paths = [pkg / RECORD, *sorted((pkg / RECORD).rglob("*"))]
    assert len(paths) > 2
    for path in paths:
        assert path.stat().st_mode & 0o555 == (0o555 if path.is_dir() else 0o444), path


@pytest.mark.parametrize("pin", ["missing", "SGLANG_VERSION = 0.5.20\n", 'SGLANG_VERSION="0.5.20"\n',
                                 "SGLANG_COMMIT=abc\n"])
def test_a_missing_or_malformed_pin_is_one_line(fake, tmp_path, pin):
    if pin == "missing":
        (fake.root / "sglang.pin").unlink()
    else:
        (fake.root / "sglang.pin").write_text(pin)
    for script, *args in (("status", tmp_path), ("apply", tmp_path), ("install-into-python", "--python", "python3"),
                          ("build-pristine",), ("fetch-wheel",)):
        proc = subprocess.run([str(fake.root / "scripts" / script), *map(str, args)], capture_output=True, text=True)
        refused(proc, "sglang.pin")
        assert proc.stderr.startswith("error: ") and not (fake.root / "build").exists()


def test_fetch_wheel_takes_only_a_wheel_for_the_interpreter_asked_for(fake, tmp_path):
    """The cached cp311 wheel is not taken for 3.12 (the interpreters here 'download' their wheel)."""
    def python(tag: str) -> Path:
        exe = tmp_path / f"python-{tag}"
        exe.write_text(f'#!/bin/sh\ncase "$2" in *cache_tag*) echo cpython-{tag}-linux-x86_64; exit 0;; esac\n'
                       f'while [ "$1" != -d ]; do shift; done; mkdir -p "$2"\n'
                       f'touch "$2/sglang-0.5.20-cp{tag}-cp{tag}-manylinux_2_34_x86_64.whl"\n')
        exe.chmod(0o755)
        return exe

    def fetch(tag: str) -> str:
        proc = subprocess.run([str(fake.root / "scripts" / "fetch-wheel")], capture_output=True, text=True,
                              env=dict(os.environ, PYTHON=str(python(tag))))
        assert proc.returncode == 0, proc.stderr
        return Path(proc.stdout.strip()).name

    for tag in ("311", "312", "311"):  # the second 311 from the cache
        assert fetch(tag) == f"sglang-0.5.20-cp{tag}-cp{tag}-manylinux_2_34_x86_64.whl"


def test_build_pristine_lays_out_the_wheel_once_and_refuses_a_changed_tree(fake, tmp_path):
    """The wheel's sglang/ committed and tagged (not over a stopped run's leftovers; an earlier pin's tree
    replaced); taken as it is on a second run; an edited tree or one without the tag refused and kept."""
    wheel = fake.root / "build" / "cache" / "tag" / "sglang-0.5.20-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("sglang/__init__.py", "")
        archive.writestr("sglang/_version.py", "__version__ = version = '0.5.20'\n")
        archive.writestr("sglang-0.5.20.dist-info/METADATA", "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.20\n")
    python = tmp_path / "python"  # reports the cache's tag; a download fails
    python.write_text('#!/bin/sh\ncase "$2" in *cache_tag*) echo tag; exit 0;; esac\nexit 1\n')
    python.chmod(0o755)
    env = {"PYTHON": str(python)}
    tree = fake.root / "build" / "sglang-wheel"
    stopped = tree.with_name("sglang-wheel.partial")  # what a stopped run leaves
    (stopped / "python/sglang").mkdir(parents=True)
    (stopped / "python/sglang/half.py").write_text("")
    shell = tmp_path / "shell"  # a shell in another repository: GIT_DIR set
    shell.mkdir()
    git(shell, "init", "-q")
    first = fake.run("build-pristine", env={**env, "GIT_DIR": str(shell / ".git")})
    assert first.returncode == 0 and first.stdout.strip() == str(tree), first.stderr
    assert not stopped.exists() and not (tree / "python/sglang/half.py").exists()
    assert (tree / "python/sglang/_version.py").read_text() == "__version__ = version = '0.5.20'\n"
    assert git(shell, "tag", "-l") == "" and (tree / ".git").is_dir()
    git(tree, "tag", "-d", "v0.5.20-wheel")  # the tree of an earlier pin: replaced
    git(tree, "tag", "v0.5.19-wheel")
    moved = fake.run("build-pristine", env=env)
    assert moved.returncode == 0 and git(tree, "tag", "-l") == "v0.5.20-wheel\n", moved.stderr
    head = git(tree, "rev-parse", "v0.5.20-wheel^{commit}").strip()
    wheel.unlink()  # a rebuild would need it
    again = fake.run("build-pristine", env=env)
    assert again.returncode == 0 and again.stdout.strip() == str(tree), again.stderr
    assert git(tree, "rev-parse", "HEAD").strip() == head
    (tree / "python/sglang/__init__.py").write_text("edited = True\n")
    refused(fake.run("build-pristine", env=env), "is not pristine", f"git -C {tree} checkout -f v0.5.20-wheel")
    git(tree, "tag", "-d", "v0.5.20-wheel")  # a repository there that is not the one this script makes
    foreign = fake.run("build-pristine", env=env)
    assert foreign.returncode == 1 and "exists but is not the tree scripts/build-pristine makes" in foreign.stderr
    assert (tree / "python/sglang/__init__.py").read_text() == "edited = True\n"


def test_git_apply_ignores_the_users_git_configuration_and_repositories(fake, tmp_path):
    """A ~/.gitconfig that rewrites whitespace, and a scratch folder inside a git repository."""
    home, scratch = tmp_path / "home", tmp_path / "repository" / "tmp"
    home.mkdir()
    (home / ".gitconfig").write_text("[core]\n\tautocrlf = true\n[apply]\n\twhitespace = fix\n")
    scratch.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(scratch.parent)], check=True)
    tree = fake.tree(tmp_path / "tree")
    proc = fake.run("apply", tree, env={"HOME": str(home), "TMPDIR": str(scratch)})
    assert proc.returncode == 0, proc.stderr
    assert digest(tree, record=False) == digest(fake.tree(tmp_path / "oracle", patched=True))
    assert fake.run("reverse", tree, env={"HOME": str(home), "TMPDIR": str(scratch)}).returncode == 0


def test_a_file_is_trusted_only_as_the_blob_the_series_names_for_sglangs_own(fake, tmp_path):
    """The first patch's result under a series whose index line names another blob for SGLang's file:
    undoing the patch does not give that blob, so the file is conflicting and nothing is written."""
    tree = fake.tree(tmp_path / "tree")
    git_apply(tree, "installed", fake.patches[:1])
    first = fake.patches[0]
    old = re.search(r"^index ([0-9a-f]{40})\.\.", first.read_text(), re.M)[1]
    first.write_text(first.read_text().replace(f"index {old}..", f"index {'1' * 40}..", 1))
    relock(fake.root / "patches")
    before = digest(tree)
    status = fake.run("status", tree)
    assert status.returncode == 3 and "conflicting" in first_line(status), status.stdout
    assert fake.run("reverse", tree).returncode == 1 and digest(tree) == before


def test_import_patches_replaces_only_a_work_folder_of_its_own_with_nothing_to_lose(fake, tmp_path):
    """Another repository, uncommitted work, unexported commits, an unfinished import, a pristine tree that
    is not one and an edited series are refused in one line, and what was there is kept."""
    pristine, work = fake.pristine.parents[1], tmp_path / "work"

    def imported(*args, into=work, source=pristine):
        return fake.run("import-patches", "--work", into, "--pristine", source, *args)

    def subjects() -> list[str]:
        return git(work, "log", "--reverse", "--format=%s", "series-base..HEAD").splitlines()

    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.txt").write_text("mine\n")
    git(other, "init", "-q")
    git(other, "add", "-A")
    git(other, "commit", "-qm", "mine")
    refused(imported(into=other), "is a git repository but not a work folder of this series")
    assert (other / "mine.txt").read_text() == "mine\n" and git(other, "log", "--format=%s") == "mine\n"

    first = imported()
    assert first.returncode == 0 and "imported 3 patches" in first.stdout, first.stderr
    assert subjects() == [subject for subject, _ in FAKE_PATCHES]
    refused(imported(source=tmp_path / "nowhere"), "is not a git tree of SGLang")
    refused(imported(source=work), "is not a git tree of SGLang")
    refused(imported(source=other), "python/sglang")   # a git tree, but not SGLang's
    elsewhere = {"GIT_DIR": str(work / ".git"), "GIT_WORK_TREE": str(work)}  # a shell in another repository
    refused(fake.run("import-patches", "--work", other, "--pristine", pristine, env=elsewhere), "not a work folder")
    assert (other / "mine.txt").read_text() == "mine\n"
    assert subjects() == [subject for subject, _ in FAKE_PATCHES]

    edited = work / "python/sglang/srt/cache.py"
    git(work, "checkout", "-qb", "experiment")
    edited.write_text(edited.read_text() + "EXPERIMENT = 1\n")
    git(work, "commit", "-qam", "an experiment")
    git(work, "checkout", "-q", "patched")
    refused(imported(), "has commits not yet exported (on any branch)")
    git(work, "branch", "-qD", "experiment")
    edited.write_text(edited.read_text() + "STASHED = 1\n")
    git(work, "stash", "-q")
    refused(imported(), "has stashed changes")
    assert "STASHED" in git(work, "stash", "show", "-p")
    git(work, "stash", "drop", "-q")
    edited.write_text(edited.read_text() + "EXTRA = 1\n")
    refused(imported(), "has uncommitted changes")
    assert edited.read_text().endswith("EXTRA = 1\n")
    git(work, "commit", "-qam", "mine too")
    refused(imported(), "has commits not yet exported")
    assert subjects()[-1] == "mine too"
    git(work, "tag", "-d", "series-exported")
    refused(imported(), "holds an import that did not finish")
    assert subjects()[-1] == "mine too"
    again = imported("--force")
    assert again.returncode == 0 and subjects() == [subject for subject, _ in FAKE_PATCHES], again.stderr

    head, patch = git(work, "rev-parse", "HEAD"), fake.patches[0]  # the sums are checked before the work folder goes
    patch.write_text(patch.read_text() + "-- \nan edit\n")
    refused(imported("--force"), "series.sha256", patch.name)
    assert git(work, "rev-parse", "HEAD") == head and git(work, "tag", "-l", "series-exported").strip()


def test_export_patches_writes_only_where_it_may(fake, tmp_path):
    """Another folder's series, a patches/ changed since the import (a pull) and a folder that is not a
    work folder are refused in one line and kept; a new folder gets the series."""
    work, patches = tmp_path / "work", fake.root / "patches"
    assert fake.run("import-patches", "--work", work, "--pristine", fake.pristine.parents[1]).returncode == 0

    def exported(*args, into=work):
        return fake.run("export-patches", "--work", into, *args)

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "0001-their-fix.patch").write_text("theirs\n")
    (theirs / "series").write_text("0001-their-fix.patch\n")
    refused(exported("--out", theirs), "holds a series already")
    assert sorted(p.name for p in theirs.iterdir()) == ["0001-their-fix.patch", "series"]
    new = exported("--out", tmp_path / "new")
    assert new.returncode == 0, new.stderr
    refused(exported("--out", tmp_path / "new"), "holds a series already")
    assert exported("--out", tmp_path / "new", "--force").returncode == 0
    names = (tmp_path / "new" / "series").read_text().split()
    assert [(tmp_path / "new" / name).read_bytes() for name in names] == [p.read_bytes() for p in fake.patches]

    pulled = fake.patches[1]
    pulled.write_text(pulled.read_text() + "-- \na change pulled after the import\n")
    relock(patches)  # a pull brings the series' sums with it
    refused(exported(), "patches/ changed since")
    assert pulled.read_text().endswith("a change pulled after the import\n")
    assert exported("--force").returncode == 0 and "pulled after" not in pulled.read_text()
    assert exported().returncode == 0  # what it exported is what patches/ holds now
    git(work, "reset", "-q", "--hard", "HEAD~1")  # a commit dropped: its patch goes
    assert exported().returncode == 0
    assert (patches / "series").read_text().split() == sorted(p.name for p in patches.glob("0*.patch"))
    assert len(fake.patches) == 2
    pulled.write_text(pulled.read_text() + "-- \nanother pull\n")
    relock(patches)
    refused(exported(), "patches/ changed since")  # each export records what it wrote

    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    refused(exported(into=other), "is not a work folder of this series")
    assert sorted(p.name for p in patches.iterdir()) == sorted(p.name for p in fake.patches) + ["series", "series.sha256"]


def test_an_import_stopped_by_a_conflict_goes_on_with_the_rest_of_the_series(fake, tmp_path):
    """git am --continue applies the patch and every one after it; an export before that is refused."""
    upstream, work = fake.pristine.parents[1], tmp_path / "work"
    pool = upstream / "python/sglang/srt/pool.py"  # SGLang moved on under patch 2
    git(upstream, "checkout", "-qb", "moved")
    pool.write_text(pool.read_text().replace("return 9\n", "return 90\n"))
    git(upstream, "commit", "-qam", "upstream moved")
    stopped = fake.run("import-patches", "--work", work, "--pristine", upstream)
    assert stopped.returncode == 1 and "git am --continue applies it and the rest" in stopped.stderr
    early = fake.run("export-patches", "--work", work, "--out", tmp_path / "early")
    assert early.returncode == 1 and "in the middle of git am" in early.stderr and not (tmp_path / "early").exists()
    resolved = work / "python/sglang/srt/pool.py"
    resolved.write_text(re.sub(r"<<<<<<< .*?>>>>>>> [^\n]*\n", "    return 90 + 1\n", resolved.read_text(), flags=re.S))
    git(work, "add", "-A")
    git(work, "am", "--continue")
    assert git(work, "log", "--reverse", "--format=%s", "series-base..HEAD").splitlines() == [
        subject for subject, _ in FAKE_PATCHES]
    done = fake.run("export-patches", "--work", work, "--out", tmp_path / "done")
    assert done.returncode == 0 and len((tmp_path / "done" / "series").read_text().split()) == 3, done.stderr


def test_check_refuses_a_tree_that_is_not_pristine(fake, tmp_path):
    """From a patched tree its round trips would report the series broken."""
    refused(fake.run("check", fake.tree(tmp_path / "tree", "checkout", patched=True)), "is not pristine (",
            "series applied")
