"""scripts/build-wheel (`make wheel`): a patched SGLang wheel pip installs without a word.

The wheel is built once from PyPI's release wheel (scripts/fetch-wheel: build/cache)
and installed with pip into a folder; the installed tree must then read as the series
applied, reverse to the release's bytes and take the series again. ~20 s: one build,
one pip install, one more build from a checkout-layout pristine tree.
"""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import runpy
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from tests.support.series_trees import PRISTINE, REAL, ROOT, needs_pristine

pytestmark = needs_pristine


def script_output(name: str) -> Path:
    proc = subprocess.run([str(ROOT / "scripts" / name)], capture_output=True, text=True, check=True)
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def base() -> Path:
    return script_output("fetch-wheel")


@pytest.fixture(scope="module")
def built(tmp_path_factory, base) -> Path:
    out = tmp_path_factory.mktemp("dist")
    proc = REAL.run("build-wheel", "--base-wheel", base, "--pristine", PRISTINE, "--out", out)
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.strip())


@pytest.fixture(scope="module")
def site(tmp_path_factory, built) -> Path:
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
                           "--disable-pip-version-check", "--target", str(target), str(built)],
                          capture_output=True, text=True,
                          # as root outside a venv (the image's tier) pip warns about that, not the wheel
                          env=dict(os.environ, PIP_ROOT_USER_ACTION="ignore"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr  # not one warning (a bad RECORD gave 549)
    return target


def test_one_version_everywhere(built, site):
    version = built.name.split("-")[1]
    assert version.startswith("0.5.20+elastichicache.g")
    info = f"sglang-{version}.dist-info"
    assert (site / info / "METADATA").is_file()
    shown = subprocess.run([sys.executable, "-m", "pip", "show", "sglang"], capture_output=True, text=True,
                           env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}).stdout
    assert f"\nVersion: {version}\n" in shown
    module = runpy.run_path(str(site / "sglang" / "_version.py"))
    assert module["__version__"] == version
    assert module["__version_tuple__"] == (0, 5, 20, version.split("+")[1])
    parsed = Version(module["__version__"])  # as version-comparing tools (kvcached's autopatch) read it
    assert parsed.public == "0.5.20" and Version("0.5.16") <= parsed < Version("0.5.21")


def test_the_record_lists_every_file_with_its_hash(built, base):
    with zipfile.ZipFile(built) as wheel:
        (record_name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
        rows = list(csv.reader(io.StringIO(wheel.read(record_name).decode())))
        assert sorted(r[0] for r in rows) == sorted(n for n in wheel.namelist() if not n.endswith("/"))
        for path, digest, size in rows:
            if path == record_name:
                assert digest == size == ""
                continue
            data = wheel.read(path)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == (f"sha256={expected}", len(data)), path
        raw = wheel.read(record_name).decode()
    with zipfile.ZipFile(base) as original:
        commas = [n for n in original.namelist() if "," in n]
    assert len(commas) > 500  # SGLang 0.5.20 ships 549 such files (kernel tuning configs)
    assert all(f'"{name}",sha256=' in raw for name in commas)


def test_the_installed_wheel_reads_as_applied_reverses_and_applies_again(site, base):
    status = REAL.run("status", site)
    assert status.returncode == 0 and status.stdout.splitlines()[0].endswith("series applied"), status.stdout
    assert "local edits" not in status.stdout
    assert REAL.run("reverse", site).returncode == 0
    with zipfile.ZipFile(base) as original:
        for rel in REAL.files:
            assert (site / "sglang" / rel).read_bytes() == original.read(f"sglang/{rel}"), rel
    applied = REAL.run("apply", site)
    assert applied.returncode == 0, applied.stderr
    assert REAL.run("status", site).returncode == 0


def test_either_pristine_source_builds_the_same_wheel(tmp_path, base, built):
    """The submodule checkout (python/sglang at the pinned commit) is as good a pristine
    source as the wheel's own tree; a tree that differs from the wheel is refused."""
    checkout = REAL.tree(tmp_path / "checkout", "checkout")
    (checkout / "python" / "sglang" / "_version.py").unlink()  # a source checkout has none
    proc = REAL.run("build-wheel", "--base-wheel", base, "--pristine", checkout, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).read_bytes() == built.read_bytes()
    edited = checkout / "python/sglang" / REAL.files[0]
    edited.write_bytes(edited.read_bytes() + b"# not the release\n")
    proc = REAL.run("build-wheel", "--base-wheel", base, "--pristine", checkout, "--out", tmp_path / "refused")
    assert proc.returncode == 1 and f"sglang/{REAL.files[0]} in the wheel differs from" in proc.stderr
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())
