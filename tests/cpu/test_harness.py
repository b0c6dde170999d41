"""One smoke test per harness tool, through the package's stand-ins (harness.fakes): each
tool runs as on a GPU machine, against stand-in servers that answer as SGLang's do, and
must write its report and reach its verdict. A verdict that can only pass proves nothing,
so the comparison and the soak also run once with a server that answers wrongly.

What the tools find on a GPU is in results/ (docs/results.md); their options and messages
are not pinned here."""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from harness import bench_server, fakes, project, servers
from harness.compare import runner as compare
from harness.compare import verdict
from harness.soak import run as soak

ROOT = project.ROOT
# The project's own tools, not the SGLang tree the image tests: left out of the image's tier.
pytestmark = pytest.mark.project_files


def gone(pid: int, within: float = 10) -> bool:
    """The process exits within `within` seconds (a zombie counts: exited, not yet reaped);
    a server's own child gets its SIGTERM with the server and may take a moment to go."""
    deadline = time.monotonic() + within
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return True
        except ChildProcessError:
            try:
                if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                    return True
            except OSError:
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def serves(port: int) -> bool:
    """Something accepts connections on the port."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- servers (a fleet)

def test_a_fleet_starts_side_by_side_each_from_its_own_tree_and_stops_whole(tmp_path):
    trees = {name: fakes.fake_tree(tmp_path / name, "compare_server", patched=name == "patched")
             for name in ("pristine", "patched")}
    base = servers.free_port_block(2)
    fleet = {name: servers.local_server(sys.executable, ["--port", str(base + 10 * i)], base + 10 * i,
                                        tmp_path / f"{name}.log", {"ENABLE_KVCACHED": str(name == "patched").lower()},
                                        tree, gpus=str(i))
             for i, (name, tree) in enumerate(trees.items())}
    try:
        assert servers.start_all(fleet, timeout=30) == {"pristine": "", "patched": ""}
        info = {name: s.post("/server_info", None, timeout=10) for name, s in fleet.items()}
    finally:
        servers.stop_all(fleet.values())
    assert [(i["patched"], i["kvcached"], i["gpus"]) for i in info.values()] == [(False, False, "0"), (True, True, "1")]
    assert all(i["pythonpath"].startswith(str(trees[n].resolve())) for n, i in info.items())
    assert all(gone(s.process.pid) and gone(info[n]["child"]) for n, s in fleet.items())
    assert not any(serves(s.port) for s in fleet.values())


# ---------------------------------------------------------------- the server comparison

@pytest.fixture
def compare_trees(tmp_path, monkeypatch):
    for name in ("pristine", "patched"):
        fakes.fake_tree(tmp_path / name, "compare_server", patched=name == "patched")
    monkeypatch.setattr(project, "check_trees", lambda pristine, patched: {"pristine": "fake", "patched": "fake"})
    monkeypatch.setattr(compare, "environment", lambda opts: {"fake": True})
    for var in ("FAKE_SKEW", "FAKE_HANG", "FAKE_IMPORT"):
        monkeypatch.delenv(var, raising=False)
    return ["--launcher", "local", "--pristine-path", str(tmp_path / "pristine"),
            "--patched-path", str(tmp_path / "patched"), "--case", "qwen2-tiny", "--host-layout", "page_first",
            "--jobs", "4", "--port", str(servers.free_port_block(4)), "--ready-timeout", "30",
            "--request-timeout", "30"]


def test_compare_judges_every_row_against_native_and_writes_its_report(compare_trees, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert compare.main([*compare_trees, "--l3", "also", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["key"].removeprefix("qwen2-tiny/page_first/"): r for r in report["rows"]}
    assert report["problems"] == [] and report["patches"] == project.patches_state()
    assert {k: r["result"].split(":")[0] for k, r in rows.items()} == {
        "native": "oracle", "elastic-contiguous": "matches native", "elastic-per-layer": "matches native",
        "pristine-contiguous": "fails as expected", "l3/native": "oracle",
        "l3/elastic-contiguous": "matches native", "l3/elastic-per-layer": "matches native"}
    l3 = verdict.hit_totals(rows["l3/elastic-per-layer"])
    assert l3["storage_tokens"] > 0 and l3["host_tokens"] == 0    # the filler pushed the set out of host memory
    assert all(r["weights_redrawn"] == [42] for r in rows.values())   # the trained-scale plugin ran on every server
    journal = out.with_suffix(".rows.jsonl")                            # rows as they finished: a cut run keeps them
    capsys.readouterr()
    assert compare.main(["--table", str(journal)]) == 0
    assert capsys.readouterr().out.count("matches native") == 4


def test_compare_fails_a_kvcached_server_whose_answers_differ(compare_trees, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_SKEW", "1")
    out = tmp_path / "report.json"
    assert compare.main([*compare_trees, "--variants", "native", "elastic-contiguous", "--out", str(out)]) == 1
    rows = json.loads(out.read_text())["rows"]
    assert [r["result"] for r in rows] == ["oracle", "differs from native"]


# ---------------------------------------------------------------- the soak

@pytest.fixture
def soak_args(tmp_path, monkeypatch):
    fakes.fake_tree(tmp_path / "tree", "soak_server")
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "tree"))     # the servers' SGLang: the caller's
    monkeypatch.setenv("SOAK_FAKE_SHM", str(shm))
    for var in ("FAKE_WRONG_ON", "FAKE_NOISE", "FAKE_DIE_ON", "FAKE_DIE_AFTER", "SGLK_REAL_LOG",
                "KVCACHED_MAX_CACHED_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "out" / "run.json"
    return out, ["--out", str(out), "--shm-dir", str(shm), "--small-catalogue", "--clients", "2",
                 "--burst-clients", "2", "--max-new-tokens", "4", "--sample-every", "0.2", "--progress-every", "2",
                 "--restart-timeout", "20", "--ready-timeout", "20", "--max-total-tokens", "4096",
                 "--floor-tokens", "800", "--max-cached-tokens", "400", "--budget-fraction", "0.3",
                 "--ref-duration", "2", "--burst-period", "3", "--request-timeout", "20", "--duration", "6"]


def test_the_soak_passes_with_every_fault_and_its_journal_gives_the_same_report(soak_args):
    out, args = soak_args
    assert soak.main(args) == 0
    report = json.loads(out.read_text())
    assert report["result"] == "pass", report["problems"]
    assert report["requests"] > 50 and report["host_hit_tokens"] > 0 and report["reclaims"] > 0
    assert {f["kind"]: f["ok"] for f in report["faults"]} == dict.fromkeys(
        ("small-host-pool", "disconnects", "flush-under-load", "kill-9"), True)
    again = soak.verdict.summarize(soak.verdict.read_journal(out.with_name("run.events.jsonl")))
    assert (again["requests"], again["reclaims"], again["result"]) == (report["requests"], report["reclaims"], "pass")


def test_the_soak_fails_a_server_that_answers_wrongly_from_host(soak_args, monkeypatch):
    out, args = soak_args
    monkeypatch.setenv("FAKE_WRONG_ON", "_s0")        # s0's answers that came back from host are wrong
    assert soak.main([*args, "--duration", "3"]) == 1
    report = json.loads(out.read_text())
    assert report["result"] == "fail" and report["mismatches"] > 0
    assert {(d["server"], d["kind"]) for d in report["oracle"]["details"]} == {("s0", "real")}


# ---------------------------------------------------------------- the server benchmark

def test_the_server_benchmark_divides_each_round_by_natives(tmp_path, monkeypatch):
    for name in ("pristine", "patched"):
        fakes.fake_tree(tmp_path / name, "bench_server")
    monkeypatch.setattr(project, "check_trees", lambda pristine, patched: {"pristine": "fake", "patched": "fake"})
    monkeypatch.setattr(servers, "machine", lambda python, tree=None: {"fake": True})
    for var in ("FAKE_CLIENT_FAIL_ON", "FAKE_DIE_LAYOUT"):
        monkeypatch.delenv(var, raising=False)
    variants = ["native", "kvcached-contiguous"]
    out = tmp_path / "run"
    assert bench_server.main([
        "--pristine-path", str(tmp_path / "pristine"), "--patched-path", str(tmp_path / "patched"),
        "--port", str(servers.free_port_block(2)), "--variants", *variants, "--rounds", "2",
        "--groups", "2", "--prompts-per-group", "2", "--system-prompt-len", "48", "--question-len", "8",
        "--output-len", "4", "--concurrency", "2", "--device-tokens", "4096", "--ready-timeout", "60",
        "--bench-timeout", "240", "--bench-client", f"{sys.executable} {fakes.script('bench_client')}",
        "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["problems"] == []
    stats = report["shapes"]["llama3-8b"]["workloads"]["shared-prefix"]["summary"]["kvcached-contiguous"]
    # the stand-in client: native 10 req/s drifting +2 % a run, contiguous 10.3 drifting -2 %;
    # each server served one warm-up run before round 1
    ratios = [10.3 * (1 - 0.02 * r) / (10 * (1 + 0.02 * r)) for r in (1, 2)]
    assert stats["metrics"]["request_throughput"]["ratios"] == pytest.approx(ratios)
    assert stats["metrics"]["request_throughput"]["ratio"] == pytest.approx(statistics.median(ratios))
    assert stats["cache"]["host_share"] == pytest.approx(600 / 800)
    assert (out / "summary.md").read_text() == bench_server.render(report)


# ---------------------------------------------------------------- the transfer benchmark

def test_the_transfer_benchmark_tables_a_saved_run_and_plots_it(tmp_path):
    meta = [dict(mode=mode, pool="meta", sglang="/t/sglang", series_applied=f"SGLang at /t: series {state}")
            for mode, state in (("native", "pristine"), ("kvcached-contiguous", "applied"))]
    cells = [dict(mode=mode, pool="MLA", direction="load", host_layout="layer_first", batch=1024, GBps=gbps,
                  kernel_us=us, byte_exact=True) for mode, gbps, us in (("native", 40.0, 110.0),
                                                                       ("kvcached-contiguous", 36.0, 100.0))]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": {"gpu": "H200", "torch": "2.11", "page_size": 64}, "rows": meta + cells}))
    table = subprocess.run([sys.executable, "-m", "harness.transfer_bench", "--table", str(run)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith("| MLA"))
    assert "| 0.90 (1.10) |" in row     # contiguous / native: 36 / 40 by events, 110 / 100 by GPU time
    assert "byte-exact load-back checks: 2 of 2 pass" in table.stdout
    try:
        import matplotlib  # noqa: F401  (requirements/bench.txt, not the tier's)
    except ImportError:
        return
    png = tmp_path / "run.png"
    subprocess.run([sys.executable, "-m", "harness.plot", str(run), str(png)], cwd=ROOT, check=True, timeout=120)
    assert png.read_bytes().startswith(b"\x89PNG")


# ---------------------------------------------------------------- the GPU rig

def test_the_real_kernels_recorder_logs_each_op_a_process_calls(tmp_path):
    """setup.sh unpacks a bundle (here a fake sgl_kernel whose op runs on the CPU), hooks the
    recorder into it and puts it first on PYTHONPATH; a process that calls the op logs it
    once, and the summary names it as run for real."""
    pkg = tmp_path / "src" / "sgl_kernel"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import torch\nIS_SGL_KERNEL_STUB = False\n__version__ = '0.4.5'\n"
        "_lib = torch.library.Library('sgl_kernel', 'DEF')\n_lib.define('rmsnorm(Tensor x) -> Tensor')\n"
        "_lib.impl('rmsnorm', lambda x: x / x.norm(), 'CPU')\n")
    bundle = tmp_path / "bundle.tgz"
    with tarfile.open(bundle, "w:gz") as tar:
        tar.add(pkg, arcname="sgl_kernel")
    log = tmp_path / "ops.log"
    env = {**os.environ, "SGLK_BUNDLE": str(bundle), "SGLK_DIR": str(tmp_path / "unpacked"), "SGLK_REAL_LOG": str(log),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    calls = ('python3 -c "import sgl_kernel, torch; torch.ops.sgl_kernel.rmsnorm(torch.ones(4)); '
             'torch.ops.sgl_kernel.rmsnorm.default(torch.ones(4))"')
    done = subprocess.run(["bash", "-c", f"source harness/rig/real_kernels/setup.sh && {calls}"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [line.split()[1] for line in log.read_text().splitlines()] == ["rmsnorm"]
    summary = subprocess.run([sys.executable, "-m", "harness.rig.real_kernels.sgl_kernel_calls", "--summary", str(log),
                              "--out", str(tmp_path / "ops.json")], cwd=ROOT, capture_output=True, text=True)
    assert summary.returncode == 0 and json.loads((tmp_path / "ops.json").read_text())["ops_called_real"] == ["rmsnorm"]


def test_the_device_session_times_native_on_a_pristine_copy_of_a_patched_site(tmp_path):
    """harness/rig/device_session.sh on an installed tree an earlier call patched: its copy
    for the native variant must be SGLang as shipped, the site itself patched."""
    import sglang
    site = tmp_path / "site"
    shutil.copytree(Path(sglang.__file__).parent, site / "sglang", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    if not project.tree_state(str(site)).endswith("series applied"):
        pytest.skip("the sglang on the path is not the patched tree (`make test` puts it there)")
    (tmp_path / "out").mkdir()
    env = dict(os.environ, SGLANG_SITE=str(site), PRISTINE_SITE=str(tmp_path / "pristine"), STEPS="none",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    done = subprocess.run(["bash", "harness/rig/device_session.sh", str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert project.tree_state(str(tmp_path / "pristine")).endswith("series pristine")
    assert project.tree_state(str(site)).endswith("series applied")


# ---------------------------------------------------------------- the mutation audit

def test_the_mutation_audit_finds_the_lines_the_series_adds_and_mutates_them():
    """`make mutants` runs outside the tier; here only its first step, on the tier's trees."""
    import sglang

    from harness.mutants.operators import line_mutants
    from harness.mutants.series_lines import series_lines
    if not os.environ.get("PRISTINE_SGLANG"):
        pytest.skip("set by `make test`: PRISTINE_SGLANG, the pristine tree's python/ folder")
    patched = Path(sglang.__file__).resolve().parents[1]
    files = series_lines(Path(os.environ["PRISTINE_SGLANG"]), patched)
    assert files and all(f.path.startswith("sglang/") and f.lines for f in files)
    first = files[0]
    source = (patched / first.path).read_text()
    assert any(line_mutants(first.path, source, n) for n in first.lines)
