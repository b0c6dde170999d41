"""`make bench-sharing` (harness/sharing): the whole tool through stand-in servers on a tiny
plan, its sample catching a wrong answer, the report's numbers from a planted journal, and
the budget arithmetic that gives the variants equal memory."""
from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from harness import fakes, project, servers
from harness.sharing import ballast, plan as P, run, summary
from harness.soak.verdict import read_journal

pytestmark = pytest.mark.project_files

B, D = P.BASELINE, P.PRODUCT
# two copies of harness/compare's tiny MHA config (16 KiB of KV a token, 1,024 tokens a
# kvcached page); a 64 MiB budget: a static share of 2,048 tokens under a working set of
# 2,688; the sample's prefixes (1,536 tokens) over kvcached's cap (1,024): they come back from host
TINY = {"models": ["qwen2-tiny", "qwen2-tiny"], "variants": [B, D], "rounds": 2, "phases": ["bursts", "even"],
        "even_rounds": 2, "phase_s": 1.5, "drain_s": 10, "windows": 2, "burst_rate": 12, "idle_rate": 2,
        "wave_rate": 12, "even_rate": 6, "kv_budget_gib": 0.0625, "host_gb": 0.1, "groups": 4, "prefix_tokens": 512,
        "conversations": 2, "turns": 2, "user_tokens": 32, "reply_tokens": 16, "max_new_tokens": 4,
        "sample_groups": 3, "sample_prefix_tokens": 512, "sample_questions": 2, "sample_question_tokens": 32,
        "sample_new_tokens": 4, "warmup_s": 0.5, "request_timeout_s": 30, "server_flags": []}
FREE, TOTAL = 8_000_000_000, 10_000_000_000      # the stand-in GPU the ballast measures


def run_tool(folder: Path, plan: dict, monkeypatch, **env) -> tuple[int, Path]:
    for name in ("pristine", "patched"):
        fakes.fake_tree(folder / name, "sharing_server", patched=name == "patched")
    shm = folder / "shm"
    shm.mkdir(exist_ok=True)
    monkeypatch.setattr(project, "check_trees", lambda pristine, patched: {"pristine": "fake", "patched": "fake"})
    monkeypatch.setattr(servers, "machine", lambda python, tree=None: {"fake": True})
    for var in ("FAKE_WRONG_ON", "FAKE_POOL_SHORT", "FAKE_RETRACT_EVERY", "FAKE_TOKEN_S", "KVCACHED_MAX_CACHED_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SHARING_FAKE_SHM", str(shm))
    monkeypatch.setenv(ballast.FAKE, f"{FREE},{TOTAL}")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    (folder / "plan.json").write_text(json.dumps(plan))
    out = folder / "out"
    code = run.main(["--plan", str(folder / "plan.json"), "--pristine-path", str(folder / "pristine"),
                     "--patched-path", str(folder / "patched"), "--out", str(out), "--shm-dir", str(shm),
                     "--ready-timeout", "60", "--settle-s", "0", "--port", str(servers.free_port_block(4))])
    return code, out


# ---------------------------------------------------------------- the whole tool

def test_a_tiny_run_journals_every_request_and_reports_equal_budgets(tmp_path, monkeypatch):
    code, out = run_tool(tmp_path, TINY, monkeypatch, FAKE_RETRACT_EVERY="7")
    rep, events = json.loads((out / "report.json").read_text()), read_journal(out / "journal.jsonl")
    assert code == 0, rep["problems"]
    assert rep["problems"] == [] and rep["complete"]
    assert events[0]["type"] == "run" and events[-1]["type"] == "done"
    # every variant twice, the order rotated
    slots = [(e["round"], e["variant"], e["status"]) for e in events if e["type"] == "slot"]
    assert slots == [(0, B, "done"), (0, D, "done"), (1, D, "done"), (1, B, "done")]
    phases = {(e["round"], e["variant"], e["phase"]) for e in events if e["type"] == "phase"}
    assert phases == {(r, v, p) for r in (0, 1) for v in (B, D) for p in ("bursts", "even")}
    load = [e for e in events if e["type"] == "request" and e["role"] == "load"]
    assert all(e["outcome"] == "ok" and e["ttft"] > 0 and e["out"] == 4 and len(e["itl_ms"]) == 3 for e in load)
    # the same arrivals and prompts in every slot
    arrivals: dict[tuple, list] = {}
    for e in load:
        arrivals.setdefault((e["round"], e["variant"]), []).append((e["phase"], e["model"], e["sched"], e["key"]))
    assert len(arrivals) == 4 and len({tuple(sorted(a)) for a in arrivals.values()}) == 1
    # both models in both phases, and the counts add up to the report's
    for phase, v, r in itertools.product(("bursts", "even"), (B, D), (0, 1)):
        got = rep["phases"][phase][v]["rounds"][r]
        mine = [e for e in load if (e["round"], e["variant"], e["phase"]) == (r, v, phase)]
        assert got["total"]["answered"] == len(mine) > 0
        assert {m for m in got["models"] if got["models"][m]["answered"]} == {"qwen2-tiny-1", "qwen2-tiny-2"}
    # the servers got the planned pools; (b) and (d) the same host memory
    plan = P.plan_from(P.PRESETS["two-mha"], TINY)
    planned = {(v, label): (b.device_tokens, b.cached_tokens) for (v, label), b in P.budgets(plan).items()}
    assert all((s["pool_tokens"], s["cached_cap"]) == planned[(s["variant"], s["model"])] for s in rep["servers"].values())
    assert {s["host_gb"] for s in rep["servers"].values()} == {TINY["host_gb"]}
    # a kvcached slot's ballast leaves the pools exactly the budget
    held = [e for e in events if e["type"] == "ballast"]
    assert [e["variant"] for e in held] == [D, D]
    assert all(e["left_for_kv"] + e["mapped"] == plan.budget_bytes for e in held)
    assert all(e["headroom"] == 500_000_000 and e["left_for_kv"] == FREE - e["held"] - 500_000_000 for e in held)
    # (d) answered the sample as the native reference did, some of it from host
    c = rep["correctness"]
    assert (c["verdict"], c["checked"], c["matched"]) == ("pass", 24, 24) and c["host_hit_tokens"] > 0
    # HiCache served host hits under load; retractions found in the answers and in the logs
    assert rep["phases"]["bursts"][D]["total"]["host_hit_tokens"]["median"] > 0
    assert sum(x["retractions"] for p in rep["phases"].values() for e in p.values() for x in
               (r["total"] for r in e["rounds"] if r)) > 0
    assert sum(n for e in rep["slots"] for n in e["log_retractions"].values()) > 0
    # the report is what its journal gives
    assert json.loads(json.dumps(summary.summarize(events))) == rep
    assert (out / "summary.md").read_text() == summary.render(rep)


def test_a_wrong_answer_from_host_fails_the_run(tmp_path, monkeypatch):
    plan = {**TINY, "rounds": 1, "phases": ["even"], "warmup_s": 0}
    code, out = run_tool(tmp_path, plan, monkeypatch, FAKE_WRONG_ON=f"_{D}_qwen2-tiny-2")
    c = json.loads((out / "report.json").read_text())["correctness"]
    assert code == 1 and c["verdict"] == "MISMATCH" and {m["model"] for m in c["mismatches"]} == {"qwen2-tiny-2"}
    assert all(m["host"] > 0 for m in c["mismatches"]) and c["matched"] == c["checked"] - len(c["mismatches"])


# ---------------------------------------------------------------- the report's arithmetic

def planted_plan() -> P.Plan:
    return P.plan_from(P.PRESETS["two-mha"], {**TINY, "phases": ["bursts", "even"], "even_rounds": 1})


def request(r, v, phase, model, ttft, itl=(), out=4, device=0, host=0, retractions=0, outcome="ok"):
    e = {"type": "request", "role": "load", "round": r, "variant": v, "phase": phase, "model": model, "key": "k",
         "sched": 0.0, "sent": 0.1, "in": 100, "outcome": outcome}
    if outcome == "ok":
        e.update(ttft=ttft, itl_ms=list(itl), out=out, device=device, host=host, cached=device + host,
                 retractions=retractions)
    return e


def planted_events() -> list[dict]:
    plan = planted_plan()
    m1, m2 = plan.labels
    config = run.config_of(plan, type("O", (), {"preset": "two-mha", "gpu": "0"})(), [], {})
    ev = [{"type": "run", "config": config}]
    for (v, label), b in P.budgets(plan).items():
        ev.append({"type": "server", "label": f"{v}/{label}", "variant": v, "model": label, "event": "ready",
                   "pool_tokens": b.device_tokens, "planned_tokens": b.device_tokens, "host_gb": 0.1,
                   "cached_cap": b.cached_tokens, "planned_cached_tokens": b.cached_tokens,
                   "kvcached_lines": ["x"] if v == D else [], "weights_redrawn": [7]})
    # round 1, (b), bursts: m1 four answers and an error, m2 two answers; 2 s
    ev += [request(0, B, "bursts", m1, 0.1, (10, 20), device=64), request(0, B, "bursts", m1, 0.2, (30,), host=128),
           request(0, B, "bursts", m1, 0.3), request(0, B, "bursts", m1, 0.4, (40,), retractions=1),
           request(0, B, "bursts", m1, None, outcome="error"),
           request(0, B, "bursts", m2, 1.5, (50,)), request(0, B, "bursts", m2, 0.5, (60,))]
    ev.append({"type": "phase", "round": 0, "variant": B, "phase": "bursts", "duration": 2.0})
    # round 1, (d), bursts: six answers of TTFT 0.1 s in 1.5 s
    ev += [request(0, D, "bursts", m, 0.1) for m in (m1, m1, m1, m2, m2, m2)]
    ev.append({"type": "phase", "round": 0, "variant": D, "phase": "bursts", "duration": 1.5})
    # round 2: (b) four answers of 0.2 s in 2 s; (d) three of 0.5 s in 2 s
    ev += [request(1, B, "bursts", m1, 0.2) for _ in range(4)]
    ev.append({"type": "phase", "round": 1, "variant": B, "phase": "bursts", "duration": 2.0})
    ev += [request(1, D, "bursts", m2, 0.5) for _ in range(3)]
    ev.append({"type": "phase", "round": 1, "variant": D, "phase": "bursts", "duration": 2.0})
    # even, round 1 only: (b) 10 answers in 5 s, (d) 9
    ev += [request(0, B, "even", m1, 0.05) for _ in range(10)]
    ev.append({"type": "phase", "round": 0, "variant": B, "phase": "even", "duration": 5.0})
    ev += [request(0, D, "even", m1, 0.05) for _ in range(9)]
    ev.append({"type": "phase", "round": 0, "variant": D, "phase": "even", "duration": 5.0})
    # the sample: the reference's answers, (d)'s: one differs at its third token
    ev += [{"type": "request", "role": "reference", "model": m1, "key": k, "outcome": "ok", "output_ids": [1, 2, 3]}
           for k in ("s0q0", "s0q1")]
    ev += [{"type": "request", "role": "sample", "round": 0, "model": m1, "key": "s0q0", "outcome": "ok",
            "output_ids": [1, 2, 3], "device": 0, "host": 64},
           {"type": "request", "role": "sample", "round": 0, "model": m1, "key": "s0q1", "outcome": "ok",
            "output_ids": [1, 2, 4], "device": 0, "host": 128}]
    return ev


def test_a_planted_journal_gives_the_hand_computed_numbers():
    rep = summary.summarize(planted_events())
    m1, m2 = planted_plan().labels
    b = rep["phases"]["bursts"][B]
    one = b["rounds"][0]
    assert one["models"][m1]["request_throughput"] == pytest.approx(4 / 2.0)
    assert one["total"]["request_throughput"] == pytest.approx(6 / 2.0)
    assert one["total"]["output_throughput"] == pytest.approx(24 / 2.0)
    assert one["models"][m1]["ttft_mean_ms"] == pytest.approx(250)
    assert one["models"][m1]["ttft_p50_ms"] == pytest.approx(250)
    assert one["models"][m1]["ttft_p99_ms"] == pytest.approx(300 + 0.97 * 100)     # linear, between 300 and 400
    assert one["total"]["ttft_p50_ms"] == pytest.approx(350)                        # 100 200 300 400 500 1500
    assert one["total"]["ttft_p99_ms"] == pytest.approx(500 + 0.95 * 1000)
    assert one["models"][m1]["itl_p50_ms"] == pytest.approx(25)
    assert one["total"]["itl_p50_ms"] == pytest.approx(35)
    assert one["total"]["slo_share"] == pytest.approx(5 / 7)                        # the error is a miss
    assert (one["total"]["device_hit_tokens"], one["total"]["host_hit_tokens"], one["total"]["retractions"]) \
        == (64, 128, 1)
    # across rounds: values, median, spread; ratios to (b) of the same round
    d = rep["phases"]["bursts"][D]["total"]["request_throughput"]
    assert d["values"] == pytest.approx([6 / 1.5, 3 / 2.0])
    assert d["ratios"] == pytest.approx([4.0 / 3.0, 1.5 / 2.0])
    assert d["ratio"] == pytest.approx(statistics.median([4 / 3, 0.75]))
    assert (d["ratio_min"], d["ratio_max"]) == pytest.approx((0.75, 4 / 3))
    assert b["total"]["request_throughput"]["median"] == pytest.approx(2.5)
    assert rep["phases"]["even"][D]["total"]["request_throughput"]["values"] == pytest.approx([1.8, None])
    verdicts = {(t["phase"], t["metric"], t["op"]): t["verdict"] for t in rep["targets"]}
    assert verdicts[("bursts", "request_throughput", ">")] == "met"                 # median 1.04
    assert verdicts[("bursts", "ttft_p99_ms", "<")] == "within spread"              # 100/1450 then 500/200
    assert verdicts[("bursts", "ttft_p99_ms", "<=")] == "within spread"
    assert verdicts[("even", "request_throughput", ">=")] == "short (one round)"    # 0.9
    c = rep["correctness"]
    assert (c["verdict"], c["checked"], c["matched"]) == ("MISMATCH", 2, 1)
    assert c["mismatches"] == [{"round": 0, "model": m1, "key": "s0q1", "first_difference": 2, "device": 0,
                                "host": 128}]
    assert rep["problems"]                  # the mismatch, the failed request, no end of run
    # a kvcached server whose log shows no cap on cached tokens is one problem more
    uncapped = planted_events()
    next(e for e in uncapped if e["type"] == "server" and e["variant"] == D)["cached_cap"] = None
    assert len(summary.summarize(uncapped)["problems"]) == len(rep["problems"]) + 1


# ---------------------------------------------------------------- plans and budgets

def plans() -> list[P.Plan]:
    mix_two = P.plan_from(P.PRESETS["mix"], {"models": ["qwen3.5-4b-slim", "deepseek-v2-lite-slim"], "windows": 4,
                                              "kv_budget_gib": 6.0})
    return [*P.PRESETS.values(), mix_two, P.plan_from(P.PRESETS["two-mha"], TINY)]


@pytest.mark.parametrize("plan", plans(), ids=lambda p: "+".join(p.models))
def test_every_variant_gets_the_same_kv_and_host_memory(plan):
    assert P.problems(plan) == []
    totals = P.variant_totals(plan)
    budgets = P.budgets(plan)
    for v, t in totals.items():
        var = P.VARIANTS[v]
        mine = [budgets[(v, label)] for label in plan.labels]
        if var.kvcached:
            assert t["kv_bytes"] == plan.budget_bytes
            # any one model may grow to the whole budget, whole pages
            for b in mine:
                m = plan.model(b.model)
                assert 0 <= plan.budget_bytes - b.kv_bytes < m.page_size * m.kv_bytes_per_token
        else:
            # the shares, each whole pages under its n-th, add up to the budget less the rounding
            slack = sum(plan.model(label).page_size * plan.model(label).kv_bytes_per_token for label in plan.labels)
            assert 0 <= plan.budget_bytes - t["kv_bytes"] < slack
            for b in mine:
                assert b.kv_bytes <= plan.budget_bytes / len(plan.models)
        assert t["host_gb"] == (plan.host_gb * len(plan.models) if var.hicache else 0)
    # the even split, and kvcached's cap under it
    for label in plan.labels:
        static = budgets[(B, label)].device_tokens
        assert budgets[(D, label)].cached_tokens == pytest.approx(plan.cached_fraction * static,
                                                                  abs=plan.model(label).page_size)
        assert plan.working_set() > static
