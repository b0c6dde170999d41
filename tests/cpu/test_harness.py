"""One smoke test per harness tool, against the stand-in servers of harness.fakes: it must
write its report and reach its verdict; the comparison and the soak also fail a server that
answers wrongly. The soak's fixed budget is also tested in parts (limits, ballast, reclaims)."""
from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness import bench_server, fakes, project, results, servers
from harness import report as render
from harness.compare import runner as compare
from harness.compare import verdict
from harness.sharing import ballast
from harness.soak import fleet as fleets
from harness.soak import kvc
from harness.soak import run as soak

ROOT = project.ROOT
# The project's own tools, not the SGLang tree the image tests: left out of the image's tier.
pytestmark = pytest.mark.project_files


def gone(pid: int, within: float = 10) -> bool:
    """The process exits (a zombie counts) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def serves(port: int) -> bool:
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
    monkeypatch.setenv("SOAK_FAKE_GPU", str(10 << 30))                # the GPU the servers and the ballast share
    for var in ("FAKE_WRONG_ON", "FAKE_NOISE", "FAKE_DIE_ON", "FAKE_DIE_AFTER", "SGLK_REAL_LOG",
                "KVCACHED_MAX_CACHED_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "out" / "run.json"
    return out, ["--out", str(out), "--shm-dir", str(shm), "--small-catalogue", "--clients", "2",
                 "--burst-clients", "2", "--max-new-tokens", "8", "--sample-every", "0.1", "--progress-every", "2",
                 "--restart-timeout", "20", "--ready-timeout", "20", "--max-total-tokens", "4096",
                 "--max-cached-tokens", "400", "--budget-fraction", "0.15", "--warmup-s", "1", "--settle-s", "0.2",
                 "--ref-duration", "2", "--burst-period", "3", "--request-timeout", "20", "--duration", "6"]


@pytest.mark.parametrize("mode", ["fixed", "arbiter"])
def test_the_soak_passes_with_every_fault_and_its_journal_gives_the_same_report(soak_args, mode):
    out, args = soak_args
    extra = [] if mode == "fixed" else ["--budget-mode", "arbiter", "--floor-tokens", "800", "--budget-fraction", "0.3"]
    assert soak.main([*args, *extra]) == 0
    report = json.loads(out.read_text())
    assert report["result"] == "pass", report["problems"]
    assert report["requests"] > 50 and report["host_hit_tokens"] > 0 and report["reclaims"] > 0
    assert {f["kind"]: f["ok"] for f in report["faults"]} == dict.fromkeys(
        ("small-host-pool", "disconnects", "flush-under-load", "kill-9"), True)
    events = soak.verdict.read_journal(out.with_name("run.events.jsonl"))
    again = soak.verdict.summarize(events)
    assert (again["requests"], again["reclaims"], again["result"]) == (report["requests"], report["reclaims"], "pass")
    # its committed summary (`harness.results add soak`), as `make report` renders it
    doc = results.make("soak", "2999-01-01-cpu-soak", [out.with_name("run.events.jsonl")], "a planted soak")
    assert doc["command"] and doc["series"]["digest"] and doc["date"] == "2999-01-01"
    assert report["environment"]["python"] and doc["versions"] == results.environment_fields(report)["versions"]
    (row,) = doc["data"]["reports"]
    assert (row["result"], row["requests"], row["problems"]) == ("pass", report["requests"], [])
    assert f"| run | pass | {report['duration_s']} |" in render.soak(doc["data"])
    # a report from before reports kept their environment: made again from its journal, else refused
    older = out.parent / "older"
    older.mkdir()
    (older / "run.json").write_text(json.dumps({k: v for k, v in report.items() if k != "environment"}))
    with pytest.raises(results.SummaryError, match="give its journal, run.events.jsonl"):
        results.make("soak", "2999-01-01-cpu-soak", [older / "run.json"], "a planted soak")
    shutil.copy(out.with_name("run.events.jsonl"), older)
    assert results.make("soak", "2999-01-01-cpu-soak", [older / "run.json"], "a planted soak")["machine"] == doc["machine"]
    config = report["config"]
    assert config["budget_mode"] == mode and config["hybrid_reserve"] == "whole"
    assert [s["model"] for s in report["servers"] if s["role"] == "shared"] == list(soak.DEFAULT_MODELS)
    if mode == "arbiter":
        return
    # no controller: the allocators grown first, then each live shared server's limit the one
    # set at the start, but while the killed one restarts (the others held at what they mapped)
    sample = lambda e: e["type"] == "sample"
    began = next(e["t"] for e in events if e["type"] == "budget")
    warm = [e for e in events if e["type"] == "request" and e["role"] == "warmup"]
    assert warm and all(e.get("match") for e in warm) and max(e["t"] for e in warm) < began
    kill = next(e for e in events if e["type"] == "server" and e["event"] == "killed")
    back = next(e["t"] for e in events if e["type"] == "server" and e["event"] == "ready"
                and e["server"] == kill["server"] and e["t"] > kill["t"])
    held = next(f for f in report["faults"] if f["kind"] == "kill-9")["detail"]["held_bytes"]
    limits = config["limits_bytes"]
    assert set(held) == set(limits) - {kill["server"]}
    seen = [(e["t"], n, c["limit"]) for e in events if sample(e) and e["t"] >= began
            for n, c in e["instances"].items() if c["role"] == "shared" and c["live"]]
    assert {n for _, n, _ in seen} == set(limits)
    assert all(limit == limits[n] or (n in held and limit == held[n] and kill["t"] - 1 < t < back + 1)
               for t, n, limit in seen)
    assert any(n in held and limit == held[n] != limits[n] for _, n, limit in seen)
    last = [e for e in events if sample(e)][-1]["instances"]        # after the rejoin: released
    assert {n: c["limit"] for n, c in last.items() if c["role"] == "shared"} == limits
    # the ballast left the servers the budget (what they mapped, and 0.15 of what they want beyond it)
    wants, mapped = sum(config["wants_bytes"].values()), config["mapped_at_start_bytes"]
    assert mapped == config["ballast"]["mapped"] and config["budget_bytes"] == mapped + int(0.15 * (wants - mapped))
    at_start = next(e for e in events if sample(e) and e["t"] >= began)["instances"]
    assert mapped == sum(kvc.mapped(c) for c in at_start.values() if c["role"] == "shared") > 0
    assert config["ballast"]["left_for_kv"] == config["budget_bytes"] - mapped
    assert 0 < report["budget"]["mapped_max_bytes"] <= config["budget_bytes"]
    over = {**report, "budget": {**report["budget"], "over_budget_share": 0.25}}
    assert soak.verdict.problems(over) == ["the servers mapped more than the budget in 25% of the samples: the "
                                           "GPU did not hold them to it, and a reclaim then proves nothing"]
    # its reclaims: pages one server gave back and another mapped with the budget full
    ended = next(e["t"] for e in events if e["type"] == "phase" and e["phase"] == "shared" and e["event"] == "end")
    budget_samples = [e for e in events if sample(e) and began <= e["t"] <= ended]
    assert kvc.moves(budget_samples, config["budget_bytes"], config["reclaim_min_bytes"])["count"] == report["reclaims"]


def test_the_soak_fails_when_the_gpu_cannot_hold_the_budget(soak_args, monkeypatch):
    out, args = soak_args
    monkeypatch.setenv("SOAK_FAKE_GPU", str(20 << 20))      # less free than the budget: the ballast holds nothing
    # (a request the full GPU leaves waiting gives up after 2 s)
    assert soak.main([*args, "--no-reference", "--duration", "2", "--request-timeout", "2"]) == 1
    report = json.loads(out.read_text())
    assert report["result"] == "fail" and "error" in report["config"]["ballast"] and not report["requests"]
    assert any("ballast" in p for p in report["problems"])


def test_a_failing_harness_still_writes_its_report_and_says_done(soak_args, monkeypatch):
    out, args = soak_args
    monkeypatch.setattr(soak.Soak, "start_servers", lambda self: 1 / 0)
    assert soak.main(args) == 1
    status = json.loads(out.with_name("run.status.json").read_text())
    assert status["done"] and status["result"] == "fail"
    problems = json.loads(out.read_text())["problems"]
    assert any(p.startswith("the harness failed: ") and "ZeroDivisionError" in p for p in problems)


def test_the_soak_fails_a_server_that_answers_wrongly_from_host(soak_args, monkeypatch):
    out, args = soak_args
    monkeypatch.setenv("FAKE_WRONG_ON", "_s0")        # s0's answers that came back from host are wrong
    assert soak.main([*args, "--duration", "3"]) == 1
    report = json.loads(out.read_text())
    assert report["result"] == "fail" and report["mismatches"] > 0
    assert {(d["server"], d["kind"]) for d in report["oracle"]["details"]} == {("s0", "real")}


MIB = 1 << 20


def test_fixed_limits_are_set_once_and_set_back_only_after_a_restart(tmp_path):
    """Each limit: the budget less the others' floors, at most what the pool wants, split over
    the server's KV segments (a Mamba pool keeps what it wants); written once, again only
    after a restart; while a killed server restarts, the others' KV segments held at what they map."""
    shm = tmp_path / "shm"
    shm.mkdir()
    # t_s2: a hybrid with two KV pools (group 0 and 1) and a Mamba pool (kvcached numbers its groups from 1000)
    wants = {"t_s0": 64 * MIB, "t_s1": 16 * MIB, "t_s2": 8 * MIB, "t_s2_g1": 8 * MIB, "t_s2_g1000": 16 * MIB}
    up = threading.Event()
    up.set()
    members = {f"s{i}": SimpleNamespace(label=f"s{i}", role="shared", kvcached=True, ipc_name=f"t_s{i}", up=up)
               for i in range(3)}
    fleet = fleets.Fleet(members, fleets.Journal(tmp_path / "journal.jsonl", time.time()))
    budget = kvc.Budget(fleet, str(shm), max_total_tokens=4096, burst_period=1.0)

    def write(seg, limit=None, used=0, prealloc=0):      # as kvcached does: the limit at start, then its use
        limit = kvc.read_segment(shm / seg)[0] if limit is None else limit
        (shm / seg).write_bytes(kvc.RECORD.pack(limit, used, prealloc))

    for seg, want in wants.items():
        write(seg, want)
    # budget 28 MiB; floors (512 tokens) 8, 2 and 4 MiB
    got = budget.share(list(members.values()), fraction=0.25, floor_tokens=512)
    assert got["limits_bytes"] == {"s0": 22 * MIB, "s1": 16 * MIB, "s2": 18 * MIB}
    # s2's 18 MiB over its KV pools by what they want (a quarter each); its Mamba pool keeps all it wants
    fixed = {"t_s0": 22 * MIB, "t_s1": 16 * MIB, "t_s2": 18 * MIB // 4, "t_s2_g1": 18 * MIB // 4, "t_s2_g1000": 16 * MIB}
    first = [(seg, fixed[seg]) for seg in ("t_s0", "t_s2", "t_s2_g1")]     # t_s1 and t_s2_g1000 hold theirs already
    assert budget.limits.writes == first
    fleet.shared_t0 = time.time() - 5
    for step in range(12):                               # load moving from server to server
        for i, seg in enumerate(wants):
            write(seg, used=(step * 7 + i * 3) % 11 * MIB, prealloc=MIB * (step % 2))
        budget.sample()
    assert budget.limits.writes == first
    for seg in ("t_s2", "t_s2_g1", "t_s2_g1000"):         # t_s2 restarted: kvcached wrote its full sizes
        write(seg, wants[seg])
    budget.sample()
    assert budget.limits.writes == first + [("t_s2", fixed["t_s2"]), ("t_s2_g1", fixed["t_s2_g1"])]
    assert {seg: kvc.read_segment(shm / seg)[0] for seg in wants} == fixed
    samples = [e for e in soak.verdict.read_journal(tmp_path / "journal.jsonl") if e["type"] == "sample"]
    per_server = {"s0": 22 * MIB, "s1": 16 * MIB, "s2": 25 * MIB}
    assert len(samples) == 13 and all(c["limit"] == per_server[n] for e in samples for n, c in e["instances"].items())
    # s1 killed: the others' KV segments held at what they map, at least their share of the
    # floor (s2's 4 MiB: 1 for t_s2) and above the limit too (no shrink under load); the Mamba
    # segment at its limit; then released
    write("t_s0", used=30 * MIB, prealloc=MIB)
    write("t_s2", used=0, prealloc=0)
    write("t_s2_g1", used=2 * MIB, prealloc=MIB)
    write("t_s2_g1000", used=MIB, prealloc=MIB)
    survivors = [budget.instance(members["s0"]), budget.instance(members["s2"])]
    assert budget.limits.hold(survivors) == {"s0": 31 * MIB, "s2": (1 + 3 + 16) * MIB}
    assert budget.limits.readings["t_s2_g1"] == {"limit": fixed["t_s2_g1"], "used": 2 * MIB, "prealloc": MIB,
                                                  "held": 3 * MIB}
    budget.sample()
    assert {seg: kvc.read_segment(shm / seg)[0] for seg in wants} == {**fixed, "t_s0": 31 * MIB, "t_s2": MIB,
                                                                        "t_s2_g1": 3 * MIB}
    budget.limits.release()
    assert {seg: kvc.read_segment(shm / seg)[0] for seg in wants} == fixed


def test_the_ballast_leaves_the_shared_servers_the_budget_less_what_their_counters_say_they_map(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    records = {"a": (64 * MIB, 30 * MIB, 2 * MIB), "a_g1": (32 * MIB, 10 * MIB, 0), "b": (16 * MIB, 0, 4 * MIB),
               "other": (64 * MIB, 50 * MIB, 0)}     # another instance on the GPU, not under the budget
    for name, rec in records.items():
        (shm / name).write_bytes(kvc.RECORD.pack(*rec))
    mapped = kvc.mapped_bytes(str(shm), ["a", "b"])
    assert mapped == 46 * MIB
    total, budget = 1 << 30, 100 * MIB
    monkeypatch.delenv(ballast.FAKE, raising=False)
    monkeypatch.setenv(ballast.FAKE_SHARED, str(total))
    monkeypatch.setenv(ballast.FAKE_SHM, str(shm))
    holder = ballast.Holder()
    start = lambda: holder.start(sys.executable, budget, mapped, 0.9, None, tmp_path / "ballast.log", 60)
    info = start()
    try:
        headroom = ballast.headroom(total, 0.9)
        assert info["held"] == total - 96 * MIB - headroom - (budget - mapped)
        # held, it leaves the servers what the budget has left above what they map, no more
        in_use = sum(r[1] + r[2] for r in map(kvc.read_segment, shm.iterdir()) if r)
        assert total - in_use - headroom == budget - mapped
    finally:
        assert holder.stop() is None          # held to the end
    assert sorted(p.name for p in shm.iterdir()) == sorted(records)
    # one that dies while it should hold (its memory free again) is said to have, when stopped
    assert "error" not in start()
    holder.proc.kill()
    holder.proc.wait()
    assert "exited" in (holder.stop() or "")


def moved(steps: list[dict], budget_mib: int) -> dict:
    """kvc.moves over samples of mapped MiB, one a second."""
    samples = [{"t": t, "instances": {n: {"limit": 1 << 40, "used": v * MIB, "prealloc": 0, "live": True,
                                          "role": "shared"} for n, v in step.items()}}
               for t, step in enumerate(steps)]
    return kvc.moves(samples, budget_mib * MIB, 2 * MIB)


def test_a_reclaim_without_a_controller_is_a_page_one_server_gave_back_and_another_mapped_with_the_budget_full():
    # a gives 80 MiB back, b maps them up to the budget
    assert moved([{"a": 100, "b": 20}, {"a": 20, "b": 20}, {"a": 20, "b": 100}], 120) == \
        {"count": 1, "bytes": 80 * MIB, "pairs": {"a->b": 80 * MIB}}
    # both only shrink
    assert moved([{"a": 100, "b": 20}, {"a": 60, "b": 15}, {"a": 20, "b": 10}], 120)["count"] == 0
    # b grows into pages the budget had free: nothing had to move
    assert moved([{"a": 100, "b": 20}, {"a": 20, "b": 20}, {"a": 20, "b": 100}], 240)["count"] == 0
    # b gives 80 MiB to a, then maps again what it held a moment ago: one move, not two
    assert moved([{"a": 20, "b": 100}, {"a": 100, "b": 20}, {"a": 20, "b": 100}], 120) == \
        {"count": 1, "bytes": 80 * MIB, "pairs": {"b->a": 80 * MIB}}
    # a grows into the budget's last free pages, then b shrinks: the rise came first, so not a move
    assert moved([{"a": 50, "b": 64}, {"a": 56, "b": 64}, {"a": 56, "b": 64}, {"a": 56, "b": 58}], 120)["count"] == 0
    assert moved([{"a": 50, "b": 70}, {"a": 70, "b": 70}, {"a": 70, "b": 50}], 120)["count"] == 0


def test_a_dry_run_shows_the_three_models_on_fixed_limits_with_cuda_graphs_and_starts_nothing(tmp_path, capsys):
    out = tmp_path / "soak" / "run.json"
    assert soak.main(["--dry-run", "--out", str(out)]) == 0
    plan = json.loads(capsys.readouterr().out)
    shared = [s for s in plan["servers"] if s["role"] == "shared"]
    assert [(s["model"], s["pool"]) for s in shared] == [("qwen2-tiny", "mha"), ("deepseek-v2-tiny", "mla"),
                                                         ("qwen3.5-tiny", "mamba")]
    assert plan["budget_mode"] == "fixed" and plan["ballast"] and "and 0.2 of what their pools want" in plan["budget"]
    assert not any("--disable-cuda-graph" in s["command"] for s in plan["servers"])
    # kvcached keeps the headroom the ballast leaves (--gpu-utilization)
    assert {s["env"]["KVCACHED_GPU_UTILIZATION"] for s in plan["servers"] if s["kvcached"]} == {"0.95"}
    # the hybrid's Mamba cell (over 2 MiB) on 4 MiB pages, its pools mapped whole (else kvcached
    # cannot promise it a Mamba slot when the GPU is short)
    whole = str(fleets.WHOLE_POOL_PAGES)
    assert [(s["env"].get("KVCACHED_PAGE_SIZE_MB"), s["env"].get("KVCACHED_MIN_RESERVED_PAGES"),
             s["env"].get("KVCACHED_MAX_RESERVED_PAGES")) for s in shared] == \
        [(None, None, None), (None, None, None), ("4", whole, whole)]
    assert soak.main(["--dry-run", "--out", str(out), "--hybrid-reserve", "kvcached"]) == 0  # kvcached's own
    assert not any("KVCACHED_MIN_RESERVED_PAGES" in s["env"] for s in json.loads(capsys.readouterr().out)["servers"])
    assert not any(out.parent.glob("run.*"))


# ---------------------------------------------------------------- the server benchmark

def test_the_server_benchmark_divides_each_round_by_natives(tmp_path, monkeypatch):
    for name in ("pristine", "patched"):
        fakes.fake_tree(tmp_path / name, "bench_server")
    monkeypatch.setattr(project, "check_trees", lambda pristine, patched: {"pristine": "fake", "patched": "fake"})
    monkeypatch.setattr(servers, "machine", lambda python, tree=None: {"fake": True})
    for var in ("FAKE_CLIENT_FAIL_ON", "FAKE_DIE_LAYOUT"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "run"
    assert bench_server.main([
        "--pristine-path", str(tmp_path / "pristine"), "--patched-path", str(tmp_path / "patched"),
        "--port", str(servers.free_port_block(2)), "--variants", "native", "kvcached-contiguous", "--rounds", "2",
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

def test_the_transfer_benchmark_tables_a_saved_run_plots_it_and_make_report_shows_it(tmp_path):
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
    # its summary in results/: `make report` renders it, and --check finds the page stale before
    folder, page = tmp_path / "results", tmp_path / "results.md"
    shutil.copytree(results.RESULTS, folder)
    shutil.copy(ROOT / "docs" / "results.md", page)
    doc = results.make("transfer", "2999-01-01-h200-transfer-planted", [run], "a planted run",
                       machine={"gpu": "NVIDIA H200", "gpus": 1}, compiled_ops="none")
    (folder / f"{doc['name']}.json").write_text(json.dumps(doc))
    args = ["--results", str(folder), "--out", str(page), "--plots", str(tmp_path / "plots")]
    assert render.main([*args, "--check"]) == 1
    assert render.main(args) == 0 and render.main([*args, "--check"]) == 0
    text = page.read_text()
    assert "### 2999-01-01-h200-transfer-planted: a planted run" in text
    assert "| MLA | load | layer_first | 1024 | 40.00 | - | 36.00 |" in text
    doc["compiled_ops"] = "maybe"                             # outside the schema: refused, nothing written
    (folder / f"{doc['name']}.json").write_text(json.dumps(doc))
    assert render.main(args) == 2 and page.read_text() == text
    try:
        import matplotlib  # noqa: F401  (requirements/bench.txt, not the tier's)
    except ImportError:
        return
    png = tmp_path / "run.png"
    subprocess.run([sys.executable, "-m", "harness.plot", str(run), str(png)], cwd=ROOT, check=True, timeout=120)
    assert png.read_bytes().startswith(b"\x89PNG")


# ---------------------------------------------------------------- the GPU rig

def test_the_real_kernels_recorder_logs_each_op_a_process_calls(tmp_path):
    """setup.sh hooks the recorder into a bundle's sgl_kernel (here a CPU fake): a call is logged once."""
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
    """device_session.sh on a site an earlier call patched: native's copy must be SGLang as shipped."""
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
    """Only `make mutants`' first step, on the tier's trees."""
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
