"""The first hour: what `make` does that no linter sees, run as a newcomer runs it.

The Python floor, ci/venv, `make`'s import check, the series targets (only SGLANG_DIR, quoted; `make
status` whatever the state; only FORCE=1 forces), the Mooncake skip without libibverbs1, .gitignore.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import l3_storage as l3
from tests.support.series_trees import REAL, digest

pytestmark = pytest.mark.project_files
ROOT = Path(__file__).resolve().parents[2]


def pins(*names: str) -> list[tuple[str, str]]:
    out = []
    for name in names:
        for line in (ROOT / "requirements" / name).read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                package, version = line.split("==")
                out.append((package.strip(), version.strip()))
    return out


def lowest(spec: str) -> tuple[int, ...]:
    """The oldest Python a Requires-Python allows (its >= clause; none: 0)."""
    found = re.search(r">=\s*([0-9.]+)", spec or "")
    return tuple(int(x) for x in found.group(1).rstrip(".").split(".")[:2]) if found else (0,)


def test_the_python_floor_is_the_pins_own():
    """The floor ci/venv enforces is the highest Requires-Python of the installed pins."""
    needs = {}
    for package, version in pins("cpu.txt", "lint.txt"):
        meta = importlib.metadata.metadata(package)
        assert meta["Version"] == version, package  # the environment this runs in is the pinned one
        needs[package] = lowest(meta.get("Requires-Python"))
    floor = re.findall(r"^# requires-python: >=([0-9.]+)", (ROOT / "requirements" / "cpu.txt").read_text(), re.M)
    assert len(floor) == 1 and tuple(map(int, floor[0].split("."))) == max(needs.values())


def copy_for_venv(tmp_path: Path, requirement_floor: str) -> Path:
    """ci/venv in a scratch root whose requirements/cpu.txt pins nothing."""
    root = tmp_path / "root"
    (root / "ci").mkdir(parents=True)
    (root / "requirements").mkdir()
    shutil.copy2(ROOT / "ci" / "venv", root / "ci" / "venv")
    (root / "requirements" / "cpu.txt").write_text(f"# requires-python: >={requirement_floor} (x 1.0 needs it)\n")
    (root / "requirements" / "lint.txt").write_text("")
    return root


def venv(root: Path, *args: str, python: str = sys.executable, given: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_VENV")}
    # pip offline: the requirements are empty, and `pip install --upgrade pip` has what it needs
    env.update(PYTHON=python, SGLANG_VENV_PYTHON_GIVEN="1" if given else "0", PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    return subprocess.run([str(root / "ci" / "venv"), *args], cwd=root, capture_output=True, text=True, env=env)


def test_an_old_python_is_refused_in_one_line_before_anything_is_made(tmp_path):
    root = copy_for_venv(tmp_path, "99.0")
    proc = venv(root, ".venv")
    assert proc.returncode == 1 and not (root / ".venv").exists()
    assert len(proc.stderr.splitlines()) == 1 and "99.0" in proc.stderr
    missing = venv(root, ".venv", python=str(tmp_path / "no-python"))
    assert missing.returncode == 1 and not (root / ".venv").exists()


@pytest.fixture(scope="module")
def made_venv(tmp_path_factory):
    """A venv made by ci/venv from an empty requirements file (pip upgraded, nothing else)."""
    root = copy_for_venv(tmp_path_factory.mktemp("venv"), "3.0")
    proc = venv(root, ".venv")
    assert proc.returncode == 0, proc.stderr
    assert "installing the test environment into .venv with Python" in proc.stderr
    return root


def test_a_whole_venv_is_left_alone(made_venv):
    marker = made_venv / ".venv" / "marker"
    marker.write_text("")
    proc = venv(made_venv, ".venv")
    assert proc.returncode == 0 and proc.stderr == "" and marker.exists()
    given = venv(made_venv, ".venv", given=True)  # the same interpreter, named
    assert given.returncode == 0 and given.stderr == "" and marker.exists()


@pytest.mark.parametrize("damage", ["half-built", "interpreter gone", "requirements changed", "other python given"])
def test_a_broken_or_outdated_venv_is_made_again(made_venv, tmp_path, damage):
    root = shutil.copytree(made_venv, tmp_path / "copy", symlinks=True)
    (root / ".venv" / "marker").write_text("")
    python, given = sys.executable, False
    if damage == "half-built":  # a pip install that failed: no stamp
        (root / ".venv" / ".installed").unlink()
    elif damage == "interpreter gone":
        for link in (root / ".venv" / "bin").glob("python*"):
            link.unlink()
            link.symlink_to(tmp_path / "gone")
    elif damage == "requirements changed":
        with (root / "requirements" / "cpu.txt").open("a") as handle:
            handle.write("# a new line\n")
    else:
        other = tmp_path / "python-elsewhere"  # another path to the same interpreter counts as the same
        other.symlink_to(Path(sys.executable).resolve())
        python, given = shutil.which("python3", path="/usr/bin") or "", True
        if not python or Path(python).resolve() == Path(sys.executable).resolve():
            pytest.skip("no second Python interpreter at /usr/bin/python3 here")
        same = venv(root, ".venv", python=str(other), given=True)
        assert same.returncode == 0 and same.stderr == ""
    proc = venv(root, ".venv", python=python, given=given)
    if damage == "other python given" and proc.returncode == 1 and "or newer" in proc.stderr:
        return  # /usr/bin/python3 is below the floor: refused, and said so, before the venv is touched
    assert proc.returncode == 0, proc.stderr
    assert "making .venv again" in proc.stderr and not (root / ".venv" / "marker").exists()
    assert venv(root, ".venv", python=python, given=given).stderr == ""  # whole now
    assert (root / ".venv" / ".installed").read_text().splitlines()[1] == "requirements " + hashlib.sha256(
        (root / "requirements" / "cpu.txt").read_bytes()).hexdigest()


def make(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "--no-print-directory", "-C", str(ROOT), *args], capture_output=True,
                          text=True, env={**os.environ, **env})


def test_the_import_check_hides_only_the_gpu_warnings(tmp_path):
    """No AWQ/GGUF "Only CUDA ..." warning from `make`'s import of the patched tree; any other error in full."""
    tree = os.environ["PYTHONPATH"].split(os.pathsep)[0]  # the patched tree's python/ (make test sets it)
    proc = make("import-check", f"PATCHED={Path(tree).parent}", f"VPY={sys.executable}")
    assert proc.returncode == 0 and "patched SGLang 0.5.20 imports from" in proc.stdout, proc.stderr
    assert "Warning" not in proc.stderr and "Only CUDA" not in proc.stderr, proc.stderr
    broken = tmp_path / "broken" / "python" / "sglang"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a real error')\n")
    proc = make("import-check", f"PATCHED={broken.parent.parent}", f"VPY={sys.executable}")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ImportError: a real error" in proc.stderr


def test_make_quotes_sglang_dir_and_make_status_fails_only_on_an_error(tmp_path):
    """A tree path with a space; `make status` exits 0 whatever the state (scripts/status: 3 for pristine)."""
    tree = REAL.tree(tmp_path / "a b", "installed")
    before = digest(tree)
    proc = make("status", f"SGLANG_DIR={tree}")
    assert proc.returncode == 0 and "series pristine" in proc.stdout and "Error" not in proc.stderr, proc.stderr
    assert subprocess.run([str(ROOT / "scripts" / "status"), str(tree)], capture_output=True).returncode == 3
    for target, expected in (("apply-patches", f"applied {len(REAL.patches)} patches"), ("status", "series applied"),
                             ("unapply-patches", f"reversed {len(REAL.patches)} patches")):
        proc = make(target, f"SGLANG_DIR={tree}")
        assert proc.returncode == 0 and expected in proc.stdout, proc.stderr
    assert digest(tree) == before
    bad = make("status", f"SGLANG_DIR={tmp_path}")  # not a tree: an error still fails
    assert bad.returncode != 0 and "not an SGLang tree" in bad.stderr


@pytest.mark.parametrize("force", ["0", "no", "1"])
def test_only_force_1_forces_and_the_refusal_says_force_1(tmp_path, force):
    tree = REAL.tree(tmp_path / "tree", "installed")
    edited = tree / "sglang" / REAL.files[0]
    edited.write_bytes(edited.read_bytes() + b"# a local edit\n")
    proc = make("apply-patches", f"SGLANG_DIR={tree}", f"FORCE={force}")
    if force == "1":
        assert proc.returncode == 0 and f"applied {len(REAL.patches)} patches" in proc.stdout, proc.stderr
        direct = subprocess.run([str(ROOT / "scripts" / "reverse"), str(tree)], capture_output=True, text=True)
        assert "pass --force to take the series out" in direct.stderr  # run directly, the script names its option
    else:
        assert proc.returncode != 0 and "pass FORCE=1 to apply the series over them" in proc.stderr
        assert "--force" not in proc.stderr


@pytest.mark.parametrize("target", ["apply-patches", "unapply-patches", "status"])
@pytest.mark.parametrize("given", [(), ("SGLANG_DIR=",)], ids=["unset", "empty"])
def test_without_sglang_dir_the_series_targets_refuse_and_name_it(tmp_path, target, given):
    """The operator's own SGLang or nothing: the build's own tree (PATCHED) is not read or changed instead."""
    tree = REAL.tree(tmp_path / "tree", "checkout", patched=target == "unapply-patches")
    before = digest(tree)
    proc = make(target, f"PATCHED={tree}", *given)
    assert proc.returncode != 0 and proc.stdout == "", proc.stdout
    assert len(proc.stderr.splitlines()) == 1 and "SGLANG_DIR=" in proc.stderr, proc.stderr
    assert digest(tree) == before


def test_the_mooncake_tests_skip_with_a_reason_or_fail_where_required(monkeypatch):
    monkeypatch.setattr(l3, "IBVERBS", "libno-such-library.so.1")
    monkeypatch.delenv(l3.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="libno-such-library.so.1 missing.*apt-get install libibverbs1"):
        l3.require_mooncake()
    monkeypatch.setenv(l3.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="requires the Mooncake tests to run"):
        l3.require_mooncake()


def test_build_outputs_are_ignored():
    # ".venv" itself, not only what lies under it: a worktree's .venv may be a symlink to
    # another checkout's, which "/.venv/" (directories only) would let git add
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", "dist/x.whl", "build/x", ".venv"],
                             capture_output=True, text=True).stdout.split()
    assert ignored == ["dist/x.whl", "build/x", ".venv"]
