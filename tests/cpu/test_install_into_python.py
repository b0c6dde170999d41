"""scripts/install-into-python: the image's install step, run against local SGLang folders.

The Dockerfile runs this script against the SGLang the image's Python imports; here it
runs against copies of the pristine 0.5.20 package laid out as an installed
site-packages folder and as an editable checkout (python/sglang), found through
PYTHONPATH the way the image's interpreter finds /sgl-workspace/sglang.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRISTINE = os.environ.get("PRISTINE_SGLANG")
pytestmark = pytest.mark.skipif(not PRISTINE, reason="set by `make test`: the pristine tree's python/ folder")


def install(search_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(search_path))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "install-into-python"),
                           "--python", sys.executable, *args], capture_output=True, text=True, env=env)


def copy_pristine(dest: Path) -> Path:
    shutil.copytree(Path(PRISTINE) / "sglang", dest / "sglang", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return dest


def test_installed_folder(tmp_path):
    site = copy_pristine(tmp_path / "site")
    proc = install(site)
    assert proc.returncode == 0, proc.stderr
    assert f"sglang imports from {site / 'sglang'}" in proc.stdout
    assert "series applied" in proc.stdout and "ok:" in proc.stdout
    assert "strided_device_row_stride" in (site / "sglang/srt/mem_cache/pool_host/common.py").read_text()
    again = install(site)  # idempotent: a rebuilt layer or a second run changes nothing
    assert again.returncode == 0 and "already applied" in again.stdout


def test_editable_checkout_is_patched_at_its_root(tmp_path):
    checkout = tmp_path / "sglang-checkout"
    copy_pristine(checkout / "python")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
    subprocess.run(["git", "add", "-A"], cwd=checkout, check=True)
    subprocess.run([*git, "commit", "-qm", "v0.5.20"], cwd=checkout, check=True)
    proc = install(checkout / "python")
    assert proc.returncode == 0, proc.stderr
    assert f"applying the series to {checkout}" in proc.stdout
    assert "(checkout layout): series applied" in proc.stdout


def test_no_sglang_is_a_clear_error(tmp_path):
    proc = install(tmp_path)
    assert proc.returncode != 0 and "cannot import sglang" in proc.stderr


def test_cpu_tier_needs_the_pristine_tree(tmp_path):
    site = copy_pristine(tmp_path / "site")
    assert install(site).returncode == 0
    proc = install(site, "--run-cpu-tier")
    assert proc.returncode != 0 and "already patched" in proc.stderr
