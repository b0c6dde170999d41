"""ci/report.py: docs/results.md is what the committed runs render (`make report`)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.project_files  # docs/ and the runs are not in the image


def report(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(cwd / "ci" / "report.py"), *args], cwd=cwd,
                          capture_output=True, text=True)


def test_the_committed_results_are_what_the_runs_render():
    proc = report("--check")
    assert proc.returncode == 0, proc.stderr


def test_a_newer_run_is_rendered_and_an_edit_is_caught(tmp_path):
    """A run folder of a newer date becomes the shown one; the older are listed by name;
    a hand edit of the rendered file fails --check in one line."""
    copy = tmp_path / "p"
    for part in ("ci", "docs", "bench", "tests", "scripts", "patches", "sglang.pin"):
        src = ROOT / part
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, copy / part)
    newer = copy / "docs" / "runs" / "e2e" / "2999-01-01-planted"
    newer.mkdir()
    old = sorted((ROOT / "docs" / "runs" / "e2e").glob("*/report.json.gz"))[-1]
    shutil.copy2(old, newer / "report.json.gz")
    (newer / "README.md").write_text("# a planted run\n")
    printout = copy / "docs" / "runs" / "differential" / "2999-01-01-printout"  # its outcome documents not kept
    printout.mkdir()
    (printout / "differential.log").write_text("patched: 9 cases, 90 steps, 0 not run\nidentical\n")
    (printout / "README.md").write_text("# a printout only\n")
    out = copy / "docs" / "results.md"
    assert report("--out", str(out), cwd=copy).returncode == 0
    text = out.read_text()
    assert "### `docs/runs/e2e/2999-01-01-planted`" in text and "a planted run" in text
    assert f"- `docs/runs/e2e/{old.parent.name}`" in text  # listed, no longer rendered
    assert "matches native" in text
    assert "### `docs/runs/differential/2999-01-01-printout`" in text and "patched: 9 cases, 90 steps" in text
    out.write_text(text.replace("matches native", "matched", 1))
    proc = report("--out", str(out), "--check", cwd=copy)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1 and "make report" in proc.stderr


def test_a_server_benchmark_of_one_shape_leaves_the_newest_run_of_another_shown(tmp_path):
    """bench-server runs are one shape each: a newer MLA run, or a newer MHA run of other
    variants, must not hide the newest MHA run; an older run of a shown shape and variants is listed only. "Newest" is the run's start, not its name."""
    copy = tmp_path / "p"
    for part in ("ci", "docs", "bench", "tests", "scripts", "patches", "sglang.pin"):
        src = ROOT / part
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, copy / part)
    bench = copy / "bench" / "results"
    for run in [p for p in bench.iterdir() if (p / "report.json").is_file()]:
        shutil.rmtree(run)
    runs = {p.parent.name: json.loads((p).read_text()) for p in (ROOT / "bench" / "results").glob("*/report.json")}
    one_shape = max((r for r in runs.values() if set(r["shapes"]) == {"llama3-8b"}),
                    key=lambda r: len({run["variant"] for run in r["shapes"]["llama3-8b"]["workloads"]["shared-prefix"]["runs"]}))
    variants = list(dict.fromkeys(run["variant"] for run in one_shape["shapes"]["llama3-8b"]["workloads"]["shared-prefix"]["runs"]))
    assert len(variants) >= 3

    def plant(name: str, started: str, shape: str, failed: bool = False, keep: tuple = tuple(variants)) -> None:
        report = json.loads(json.dumps(one_shape))
        report["started"], report["shapes"] = started, {shape: report["shapes"]["llama3-8b"]}
        for workload in report["shapes"][shape]["workloads"].values():
            for run in workload["runs"]:
                if failed or run["variant"] not in keep:  # a failed client run keeps empty metrics
                    run["metrics"] = {}
        (bench / name).mkdir()
        (bench / name / "report.json").write_text(json.dumps(report))
        (bench / name / "README.md").write_text(f"# {name}\n")

    plant("2999-01-01-z-mha-older", "2999-01-01 01:00:00 UTC", "llama3-8b")
    plant("2999-01-01-a-mha-newer", "2999-01-01 02:00:00 UTC", "llama3-8b")
    plant("2999-01-02-mla", "2999-01-02 01:00:00 UTC", "deepseek-v2-lite")
    plant("2999-01-05-mha-failed", "2999-01-05 01:00:00 UTC", "llama3-8b", failed=True)  # measured nothing
    plant("2999-01-04-mha-other-variants", "2999-01-04 01:00:00 UTC", "llama3-8b", keep=("native",))
    plant("2998-12-31-mha-fewer-variants", "2998-12-31 01:00:00 UTC", "llama3-8b", keep=tuple(variants[:2]))
    out = copy / "docs" / "results.md"
    assert report("--out", str(out), cwd=copy).returncode == 0
    text = out.read_text()
    assert "### `bench/results/2999-01-02-mla`" in text
    assert "### `bench/results/2999-01-01-a-mha-newer`" in text
    assert "### `bench/results/2999-01-01-z-mha-older`" not in text
    assert "- `bench/results/2999-01-01-z-mha-older`" in text
    assert "### `bench/results/2999-01-05-mha-failed`" not in text
    assert "### `bench/results/2999-01-04-mha-other-variants`" in text  # other variants: shown beside, hiding none
    assert "- `bench/results/2998-12-31-mha-fewer-variants`" in text  # a newer run measured all of its variants
