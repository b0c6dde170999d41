"""ci/rig/device_session.sh's setup, without a GPU: the benchmark's native variant
must get SGLang as shipped even when the installed tree it copies was patched by an
earlier call, and the session must stop rather than time a tree in any other state."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "ci" / "rig" / "device_session.sh"


def series_state(python_dir: Path) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "status"), str(python_dir)],
                          capture_output=True, text=True)
    return proc.stdout.splitlines()[0].rsplit("series ", 1)[-1]


def run_session(site: Path, pristine: Path, out: Path) -> subprocess.CompletedProcess:
    out.mkdir()
    env = dict(os.environ, SGLANG_SITE=str(site), PRISTINE_SITE=str(pristine), STEPS="none",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["bash", str(SESSION), str(out)], capture_output=True, text=True, env=env, timeout=600)


def patched_tree() -> Path:
    """The tier's patched SGLang: where `sglang` imports from (under `make test`
    build/sglang-patched, in the image its checkout)."""
    import importlib.util
    spec = importlib.util.find_spec("sglang")
    if not spec or not spec.origin:
        pytest.skip("no sglang on the path: `make test` puts the patched tree there")
    package = Path(spec.origin).resolve().parent
    assert series_state(package.parent) == "applied", f"{package}: the tier runs against the patched tree"
    return package


@pytest.fixture
def patched_site(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    shutil.copytree(patched_tree(), site / "sglang", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    return site


def test_the_native_copy_of_a_patched_site_is_reversed(patched_site, tmp_path):
    proc = run_session(patched_site, tmp_path / "pristine", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert series_state(tmp_path / "pristine") == "pristine"
    assert series_state(patched_site) == "applied"
    assert (tmp_path / "out" / "pristine-status.txt").read_text().splitlines()[0].endswith(": series pristine")


def test_a_stale_patched_native_copy_is_reversed(patched_site, tmp_path):
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    shutil.copytree(patched_tree(), pristine / "sglang", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    proc = run_session(patched_site, pristine, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert series_state(pristine) == "pristine"


def test_a_native_copy_that_cannot_be_made_pristine_stops_the_session(patched_site, tmp_path):
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    shutil.copytree(patched_tree(), pristine / "sglang", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    (pristine / "sglang" / "srt" / "mem_cache" / "pool_host" / "mha.py").write_text("edited = True\n")
    proc = run_session(patched_site, pristine, tmp_path / "out")
    assert proc.returncode == 1
    assert f"no pristine SGLang at {pristine} for the native variant" in proc.stderr
    assert not (tmp_path / "out" / "apply.log").exists()  # stopped before anything ran


def test_a_native_copy_with_edits_outside_the_series_stops_the_session(patched_site, tmp_path):
    # scripts/status calls such a tree pristine (none of the series in it) and lists the
    # edit: not SGLang as shipped, so not the oracle.
    if not os.environ.get("PRISTINE_SGLANG"):
        pytest.skip("set by `make test`: PRISTINE_SGLANG, the pristine tree's python/ folder")
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    shutil.copytree(Path(os.environ["PRISTINE_SGLANG"]) / "sglang", pristine / "sglang", symlinks=True)
    with open(pristine / "sglang" / "srt" / "mem_cache" / "pool_host" / "mha.py", "a") as handle:
        handle.write("\nEDITED = True\n")
    proc = run_session(patched_site, pristine, tmp_path / "out")
    assert series_state(pristine) == "pristine"
    assert proc.returncode == 1 and "local edits" in proc.stderr
    assert not (tmp_path / "out" / "apply.log").exists()
