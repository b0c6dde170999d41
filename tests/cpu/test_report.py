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
    """bench-server runs are one shape each: a newer MLA run, a newer MHA run of other variants, or
    of another workload (multi-turn), must not hide the newest MHA run; an older run of a shown shape and variants is listed only. "Newest" is the run's start, not its name."""
    copy = tmp_path / "p"
    for part in ("ci", "docs", "bench", "tests", "scripts", "patches", "sglang.pin"):
        src = ROOT / part
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, copy / part)
    bench = copy / "bench" / "results"
    for run in [p for p in bench.iterdir() if (p / "report.json").is_file()]:
        shutil.rmtree(run)
    runs = {p.parent.name: json.loads((p).read_text()) for p in (ROOT / "bench" / "results").glob("*/report.json")}
    one_shape = max((r for r in runs.values()
                     if set(r["shapes"]) == {"llama3-8b"} and "shared-prefix" in r["shapes"]["llama3-8b"]["workloads"]),
                    key=lambda r: len({run["variant"] for run in r["shapes"]["llama3-8b"]["workloads"]["shared-prefix"]["runs"]}))
    variants = list(dict.fromkeys(run["variant"] for run in one_shape["shapes"]["llama3-8b"]["workloads"]["shared-prefix"]["runs"]))
    assert len(variants) >= 3

    def plant(name: str, started: str, shape: str, failed: bool = False, keep: tuple = tuple(variants),
              workload: str = "shared-prefix") -> None:
        report = json.loads(json.dumps(one_shape))
        report["started"], report["shapes"] = started, {shape: report["shapes"]["llama3-8b"]}
        report["shapes"][shape]["workloads"] = {workload: report["shapes"][shape]["workloads"]["shared-prefix"]}
        for clients in report["shapes"][shape]["workloads"].values():
            for run in clients["runs"]:
                if failed or run["variant"] not in keep:  # a failed client run keeps empty metrics
                    run["metrics"] = {}
        (bench / name).mkdir()
        (bench / name / "report.json").write_text(json.dumps(report))
        (bench / name / "README.md").write_text(f"# {name}\n")

    plant("2999-01-01-z-mha-older", "2999-01-01 01:00:00 UTC", "llama3-8b")
    plant("2999-01-01-a-mha-newer", "2999-01-01 02:00:00 UTC", "llama3-8b")
    plant("2999-01-02-mla", "2999-01-02 01:00:00 UTC", "deepseek-v2-lite")
    plant("2999-01-03-mha-multi-turn", "2999-01-03 01:00:00 UTC", "llama3-8b", workload="multi-turn-3")
    plant("2999-01-05-mha-failed", "2999-01-05 01:00:00 UTC", "llama3-8b", failed=True)  # measured nothing
    plant("2999-01-04-mha-other-variants", "2999-01-04 01:00:00 UTC", "llama3-8b", keep=("native",))
    plant("2998-12-31-mha-fewer-variants", "2998-12-31 01:00:00 UTC", "llama3-8b", keep=tuple(variants[:2]))
    out = copy / "docs" / "results.md"
    assert report("--out", str(out), cwd=copy).returncode == 0
    text = out.read_text()
    assert "### `bench/results/2999-01-02-mla`" in text
    assert "### `bench/results/2999-01-01-a-mha-newer`" in text  # the newer multi-turn run hides no shared-prefix run
    assert "### `bench/results/2999-01-03-mha-multi-turn`" in text
    assert "### `bench/results/2999-01-01-z-mha-older`" not in text
    assert "- `bench/results/2999-01-01-z-mha-older`" in text
    assert "### `bench/results/2999-01-05-mha-failed`" not in text
    assert "### `bench/results/2999-01-04-mha-other-variants`" in text  # other variants: shown beside, hiding none
    assert "- `bench/results/2998-12-31-mha-fewer-variants`" in text  # a newer run measured all of its variants


def test_a_run_folder_it_cannot_read_is_named_in_one_line(tmp_path):
    copy = tmp_path / "p"
    for part in ("ci", "docs", "bench", "tests", "scripts", "patches", "sglang.pin"):
        src = ROOT / part
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, copy / part)
    e2e = sorted((ROOT / "docs" / "runs" / "e2e").glob("*/report.json.gz"))[-1].read_bytes()
    bench = json.loads((ROOT / "bench/results/2026-12-04-h200-bench-server-warm-up/report.json").read_text())
    del bench["started"]
    for folder, files, what in (
            ("docs/runs/e2e", {"report.json.gz": e2e, "README.md": b""}, "README.md has no title line"),
            ("docs/runs/differential", {"patched.json.gz": b"{}"}, "pristine.json.gz"),   # its pair not kept
            ("bench/results", {"report.json": json.dumps(bench).encode()}, "KeyError: 'started'"),
            ("bench/results", {"report.json": b"{"}, "JSONDecodeError: ")):
        planted = copy / folder / "2999-01-01-planted"
        planted.mkdir()
        for name, content in files.items():
            (planted / name).write_bytes(content)
        proc = report("--out", str(copy / "docs" / "results.md"), cwd=copy)
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
        assert proc.stderr.startswith(f"error: {folder}/2999-01-01-planted: ") and what in proc.stderr
        shutil.rmtree(planted)


def test_an_out_it_cannot_write_is_refused_before_rendering_and_check_reads_any_file(tmp_path):
    (tmp_path / "file").write_bytes(b"\x89PNG\r\n\x1a\n\xff")
    for out, what in ((tmp_path / "file" / "results.md", "cannot make the folder"), (tmp_path, "is a folder")):
        proc = report("--out", str(out))
        assert proc.returncode == 2 and what in proc.stderr.strip().splitlines()[-1]
    assert report("--out", str(tmp_path / "new" / "results.md")).returncode == 0
    proc = report("--check", "--out", str(tmp_path / "file"))
    assert proc.returncode == 1 and "is not what the committed runs render" in proc.stderr
