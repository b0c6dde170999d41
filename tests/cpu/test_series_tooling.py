"""scripts/apply, reverse and status on bad input: clear errors, nothing changed.

Each case runs the real scripts on a full copy of the pristine SGLang 0.5.20 package
($PRISTINE_SGLANG, set by `make test`), in both target layouts.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRISTINE = os.environ.get("PRISTINE_SGLANG")
pytestmark = pytest.mark.skipif(not PRISTINE, reason="set by `make test`: the pristine tree's python/ folder")


def run(script, *args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *map(str, args)],
                          capture_output=True, text=True)


def digest(tree: Path) -> dict[str, str]:
    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tree.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(params=["checkout", "installed"])
def target(request, tmp_path):
    package = tmp_path / ("python/sglang" if request.param == "checkout" else "sglang")
    shutil.copytree(Path(PRISTINE) / "sglang", package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return tmp_path


def series():
    return [line for line in (ROOT / "patches" / "series").read_text().split() if line]


def test_apply_then_reverse_restores_every_byte(target):
    before = digest(target)
    applied = run("apply", target)
    assert applied.returncode == 0, applied.stderr
    assert digest(target) != before
    again = run("apply", target)
    assert again.returncode == 0 and "already applied" in again.stdout
    status = run("status", target)
    assert status.returncode == 0 and all(f"[x] {p}" in status.stdout for p in series())
    reversed_ = run("reverse", target)
    assert reversed_.returncode == 0, reversed_.stderr
    assert digest(target) == before


def test_wrong_version_is_refused(target):
    version_file = next(target.rglob("sglang/_version.py"))
    version_file.write_text(version_file.read_text().replace("'0.5.20'", "'0.5.19'"))
    before = digest(target)
    proc = run("apply", target)
    assert proc.returncode != 0
    assert "expected 0.5.20, found 0.5.19" in proc.stderr
    assert digest(target) == before


def test_partly_applied_series_names_the_first_patch_that_does_not_apply(target, tmp_path):
    first = ROOT / "patches" / series()[0]
    strip = "-p1" if (target / "python").exists() else "-p2"
    subprocess.run(["git", "apply", strip, str(first)], cwd=target, check=True)
    before = digest(target)
    proc = run("apply", target)
    assert proc.returncode != 0
    assert series()[0] in proc.stderr and "nothing changed" in proc.stderr
    assert digest(target) == before


def test_local_edits_are_refused_unless_forced(target):
    mamba = next(target.rglob("sglang/srt/mem_cache/pool_host/mamba.py"))
    mamba.write_text(mamba.read_text() + "\n# a local edit\n")
    if not (target / "python").exists():
        _write_record(target, mamba)  # an installed tree is judged against its wheel RECORD
    else:  # a checkout is judged by git
        subprocess.run(["git", "init", "-q"], cwd=target, check=True)
        subprocess.run(["git", "add", "-A"], cwd=target, check=True)
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base"], cwd=target,
                       check=True)
        mamba.write_text(mamba.read_text() + "# another local edit\n")
    before = digest(target)
    proc = run("apply", target)
    assert proc.returncode != 0 and "local edits" in proc.stderr and "pool_host/mamba.py" in proc.stderr
    assert digest(target) == before
    forced = run("apply", "--force", target)
    assert forced.returncode == 0, forced.stderr


def _write_record(target: Path, edited: Path):
    """A RECORD naming the pristine hash of the edited file (as pip wrote it)."""
    import base64
    original = (Path(PRISTINE) / edited.relative_to(target)).read_bytes()
    h = base64.urlsafe_b64encode(hashlib.sha256(original).digest()).rstrip(b"=").decode()
    info = target / "sglang-0.5.20.dist-info"
    info.mkdir()
    (info / "RECORD").write_text(f"{edited.relative_to(target).as_posix()},sha256={h},{len(original)}\n")


@pytest.mark.parametrize("bad", ["missing", "not-sglang", "package-itself"])
def test_bad_paths_get_a_clear_error(tmp_path, bad):
    path = {"missing": tmp_path / "nope", "not-sglang": tmp_path}[bad] if bad != "package-itself" else None
    if bad == "package-itself":
        path = tmp_path / "sglang"
        (path / "srt").mkdir(parents=True)
    proc = run("apply", path)
    assert proc.returncode != 0 and proc.stderr.startswith("error: ")
    assert {"missing": "no such directory", "not-sglang": "not an SGLang tree",
            "package-itself": "pass the folder that holds it"}[bad] in proc.stderr


def test_two_patches_to_one_file_are_checked_in_sequence(tmp_path):
    """git apply --check forgets the first patch's result; the tooling must not."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import _series as s

    (tmp_path / "sglang").mkdir()
    source = tmp_path / "sglang" / "x.py"
    source.write_text("a\n")
    patches = []
    for i, (old, new) in enumerate((("a", "b"), ("b", "c"))):
        patch = tmp_path / f"{i}.patch"
        patch.write_text(f"diff --git a/python/sglang/x.py b/python/sglang/x.py\n--- a/python/sglang/x.py\n"
                         f"+++ b/python/sglang/x.py\n@@ -1 +1 @@\n-{old}\n+{new}\n")
        patches.append(patch)
    target = s.Target(tmp_path, 2, "installed")
    assert s.series_state(target, patches) == "pristine"
    assert source.read_text() == "a\n"  # a check changes nothing
    assert s.git_apply(target, patches[:1]).returncode == 0
    assert s.series_state(target, patches) == "partial" and s.applied_prefix(target, patches) == 1
    assert s.git_apply(target, patches[1:]).returncode == 0
    assert s.series_state(target, patches) == "applied" and source.read_text() == "c\n"
