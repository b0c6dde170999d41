"""ci/image/record.py: what `make image` records, and the check that keeps the docs from
describing an image of another series (make lint runs it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "ci" / "image" / "record.py"
pytestmark = pytest.mark.project_files


def run(*args, path=None, stdin=None):
    env = dict(os.environ, PATH=f"{path}{os.pathsep}{os.environ['PATH']}" if path else os.environ["PATH"])
    return subprocess.run([sys.executable, str(RECORD), *args], input=stdin, capture_output=True, text=True, env=env)


def fake_engine(tmp_path):
    """A podman that answers `image inspect` and `--version` like the real one."""
    engine = tmp_path / "bin" / "podman"
    engine.parent.mkdir()
    engine.write_text("#!/bin/sh\n"
                      "case \"$1\" in --version) echo 'podman version 4.3.1';;\n"
                      "image) echo '[{\"Id\": \"sha256:0123456789abcdef0123\", \"Size\": 10140000000}]';;\n"
                      "*) exit 1;; esac\n")
    engine.chmod(0o755)
    return engine.parent


def stamped_log(tmp_path, tier="457 passed in 300.1s"):
    lines = ["[+    0.0s] STEP 1/3: FROM localhost/sglang-standin:v0.5.20-cu130",
             "[+    2.5s] STEP 2/3: RUN pip install kvcached",
             "[+   62.5s] STEP 3/3: RUN scripts/install-into-python --run-cpu-tier",
             "[+  100.0s] SGLang 0.5.20 at /sgl-workspace/sglang/python/sglang (checkout layout): series applied",
             f"[+  400.0s] {tier}",
             "[+  410.5s] COMMIT sglang-elastic-hicache:0.5.20"]
    log = tmp_path / "image-build.log"
    log.write_text("\n".join(lines) + "\n")
    return log


def test_a_build_is_recorded_with_its_steps_and_series_and_checked(tmp_path):
    out, engine = tmp_path / "record.json", fake_engine(tmp_path)
    proc = run("write", "--log", str(stamped_log(tmp_path)), "--tag", "t:1", "--out", str(out), path=engine)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert [(s["step"], s["seconds"]) for s in record["steps"]] == [(1, 2.5), (2, 60.0), (3, 348.0)]
    assert record["base"] == "localhost/sglang-standin:v0.5.20-cu130"
    assert record["size_bytes"] == 10140000000 and record["image_id"].startswith("sha256:0123")
    assert record["ran_inside"]["cpu_tier"].startswith("457 passed")
    assert run("check", str(out)).returncode == 0
    # the series moves on: the record no longer describes it
    record["series"]["digest"] = "0" * 64
    out.write_text(json.dumps(record))
    proc = run("check", str(out))
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    # a build whose tier failed is not recorded
    unfinished = tmp_path / "unfinished.json"
    proc = run("write", "--log", str(stamped_log(tmp_path, tier="error: tier failed")), "--tag", "t:1",
               "--out", str(unfinished), path=engine)
    assert proc.returncode == 2 and not unfinished.exists()


def test_the_stamp_prefixes_elapsed_seconds():
    proc = run("stamp", stdin="a\nSTEP 1/2: FROM x\n")
    assert proc.returncode == 0 and all(line.startswith("[+") for line in proc.stdout.splitlines())
    assert [line.split("] ", 1)[1] for line in proc.stdout.splitlines()] == ["a", "STEP 1/2: FROM x"]
