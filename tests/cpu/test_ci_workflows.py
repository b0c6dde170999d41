"""ci/workflows: the CI gate's two workflows parse and do what the README says.

No workflow linter installs from a package registry here (actionlint's PyPI wrapper
downloads its binary from GitHub), so: YAML parse, the structure the gate relies on,
and `bash -n` over every run step (with ${{ }} expressions stubbed).
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.project_files
WORKFLOWS = ROOT / "ci" / "workflows"


def load(name):
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as true
    return data


def steps(workflow, job):
    return workflow["jobs"][job]["steps"]


def runs(workflow):
    return [s["run"] for job in workflow["jobs"].values() for s in job.get("steps", []) if "run" in s]


@pytest.mark.parametrize("name", ["cpu-tier.yml", "gpu-tier.yml"])
def test_run_steps_are_valid_bash(name):
    for script in runs(load(name)):
        stubbed = re.sub(r"\$\{\{[^}]*\}\}", "STUB", script)
        proc = subprocess.run(["bash", "-n"], input=stubbed, capture_output=True, text=True)
        assert proc.returncode == 0, f"{name}: {proc.stderr}\n{script}"


def test_cpu_tier_runs_the_readme_test_command_on_every_pull_request():
    wf = load("cpu-tier.yml")
    assert "pull_request" in wf["on"]
    job = wf["jobs"]["cpu"]
    assert job["timeout-minutes"] <= 90 and "self-hosted" not in str(job["runs-on"])
    assert any(r.strip() == "bash .ci/run" for r in runs(wf))
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()
    assert wf["permissions"] == {"contents": "read"}


def test_gpu_tier_is_started_by_a_maintainer_and_pins_the_head_sha():
    wf = load("gpu-tier.yml")
    assert list(wf["on"]) == ["issue_comment"]
    authorize = wf["jobs"]["authorize"]
    assert "'/ci run'" in authorize["if"] and "github.event.issue.pull_request" in authorize["if"]
    role, head, pending = steps(wf, "authorize")
    assert "collaborators/$ACTOR/permission" in role["run"] and "admin|maintain|write)" in role["run"]
    assert role["env"]["ACTOR"] == "${{ github.event.comment.user.login }}"
    assert "pulls/$PR" in head["run"] and ".head.sha" in head["run"]
    assert authorize["outputs"]["sha"] == "${{ steps.head.outputs.sha }}"
    assert "state=pending" in pending["run"] and pending["env"]["SHA"] == "${{ steps.head.outputs.sha }}"

    gpu = wf["jobs"]["gpu"]
    assert gpu["needs"] == "authorize" and "self-hosted" in gpu["runs-on"] and "gpu" in gpu["runs-on"]
    checkout = gpu["steps"][0]
    assert checkout["uses"].startswith("actions/checkout@")
    assert checkout["with"]["ref"] == "${{ needs.authorize.outputs.sha }}"  # not the branch: the SHA approved
    commands = " ".join(s.get("run", "") for s in gpu["steps"])
    assert "make test-gpu" in commands and "make bench" in commands
    assert "scripts/install-into-python" in commands and "--target" in commands  # a fresh tree per run

    report = wf["jobs"]["report"]
    assert set(report["needs"]) == {"authorize", "gpu"} and "always()" in report["if"]
    status = report["steps"][0]
    assert "statuses/$SHA" in status["run"] and "context=gpu-tier" in status["run"]
    assert status["env"]["SHA"] == "${{ needs.authorize.outputs.sha }}"
    assert wf["permissions"]["statuses"] == "write" and wf["permissions"]["contents"] == "read"
