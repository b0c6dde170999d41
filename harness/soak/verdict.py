"""The soak run's oracle, verdict and report, all computed from its event journal.

The journal (one JSON object a line, written as the run goes) holds every request, every
kvcached counter sample, every server event and every fault; `summarize` turns it into the
report, so a run cut short is reported from what it wrote.

Oracle. Every catalogue prompt is answered once alone (one request at a time) by the
unshared native server of its model, before any load: the reference answer (`solo`).
Every answer the load gets is compared with it (greedy tokens equal). The servers run
with `--enable-deterministic-inference` (SGLang 0.5.20, triton attention: batch-invariant
matmuls and one extend kernel whether a prefix was cached or not), so an answer should not
depend on its batch or on its cache hits. The same traffic runs on the unshared native
server first: its differences from the solo answers are the noise of the setup itself.
A kvcached answer that differs is
  - `noise` when native under load gave that same answer for that prompt;
  - `real` when native under load never differed from the solo answers for that model;
  - `unexplained` otherwise (native varied, but never this way).
`mismatches` counts real and unexplained ones; either fails the run.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

KVCACHED_ROLES = ("shared", "ref-kvcached", "rejoin", "warmup")
LOAD_ROLES = ("ref-native", *KVCACHED_ROLES)


def read_journal(path: str | Path) -> list[dict]:
    """Events of a journal; a torn last line (the writer was killed) is skipped, and so is
    any line that is not a JSON object (the file is not a journal)."""
    events = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def latency(records: list[dict]) -> dict:
    ok = [r for r in records if r.get("outcome") == "ok"]
    host = [r for r in ok if r.get("host", 0) > 0]
    ms = lambda v: None if v is None else round(v * 1000, 1)
    out = {"requests": len(ok), "host_hit_requests": len(host)}
    for name, group, field in (("ttft_host_hit", host, "ttft"), ("ttft_all", ok, "ttft"), ("latency_all", ok, "latency")):
        vals = [r[field] for r in group if r.get(field) is not None]
        out[f"{name}_p50_ms"] = ms(percentile(vals, 50))
        out[f"{name}_p99_ms"] = ms(percentile(vals, 99))
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def oracle(events: list[dict]) -> dict:
    """Every load answer against its solo reference; see the module docstring."""
    reference: dict[tuple[str, str], list[int]] = {}
    for e in events:
        if e.get("type") == "request" and e["role"] == "solo" and e.get("outcome") == "ok":
            reference.setdefault((e["model"], e["key"]), e["output_ids"])
    native_variants: dict[tuple[str, str], set] = defaultdict(set)
    native_checked: dict[str, int] = defaultdict(int)
    native_diff: dict[str, int] = defaultdict(int)
    for e in events:
        if e.get("type") == "request" and e["role"] == "ref-native" and e.get("outcome") == "ok":
            ref = reference.get((e["model"], e["key"]))
            if ref is None:
                continue
            native_checked[e["model"]] += 1
            if e["output_ids"] != ref:
                native_diff[e["model"]] += 1
                native_variants[(e["model"], e["key"])].add(tuple(e["output_ids"]))
    checked, unchecked = defaultdict(int), defaultdict(int)
    found = []
    for e in events:
        if e.get("type") != "request" or e["role"] not in KVCACHED_ROLES or e.get("outcome") != "ok":
            continue
        ref = reference.get((e["model"], e["key"]))
        if ref is None:
            unchecked[e["server"]] += 1
            continue
        checked[e["server"]] += 1
        if e["output_ids"] == ref:
            continue
        if tuple(e["output_ids"]) in native_variants[(e["model"], e["key"])]:
            kind = "noise"
        elif native_diff[e["model"]] == 0:
            kind = "real"
        else:
            kind = "unexplained"
        found.append({"kind": kind, "server": e["server"], "role": e["role"], "model": e["model"], "key": e["key"],
                      "t": e.get("t"), "first_position": first_difference(ref, e["output_ids"]),
                      "host": e.get("host", 0), "cached": e.get("cached", 0),
                      "got": e["output_ids"][:8], "want": ref[:8]})
    return {
        "references": len(reference),
        "native_noise": {m: {"checked": native_checked[m], "differ": native_diff[m]} for m in native_checked},
        "checked": dict(checked), "unchecked": dict(unchecked),
        "mismatches": sum(1 for f in found if f["kind"] != "noise"),
        "noise": sum(1 for f in found if f["kind"] == "noise"),
        "kinds": {k: sum(1 for f in found if f["kind"] == k) for k in sorted({f["kind"] for f in found})},
        "references_per_model": {m: sum(1 for (model, _) in reference if model == m)
                                 for m in sorted({model for (model, _) in reference})},
        "details": found[:50],
    }


def summarize(events: list[dict], config: dict | None = None) -> dict:
    """The run's report from its journal (config: what the run was asked to do)."""
    from harness.soak.kvc import moves, reclaims
    config = dict(config or next((e["config"] for e in events if e.get("type") == "start"), {}))
    for e in events:   # the budget is set when the shared phase begins
        if e.get("type") == "budget":
            config.update({k: v for k, v in e.items() if k not in ("type", "t")})
    requests = [e for e in events if e.get("type") == "request"]
    by_role: dict[str, list[dict]] = defaultdict(list)
    by_server: dict[str, list[dict]] = defaultdict(list)
    for r in requests:
        by_role[r["role"]].append(r)
        by_server[r["server"]].append(r)
    servers = {}
    for e in events:
        if e.get("type") == "server" and e["event"] == "launched":
            servers.setdefault(e["server"], {k: e[k] for k in ("server", "model", "pool", "kvcached", "role",
                                                                 "ipc_name", "command", "log") if k in e})
    crashes = [e for e in events if e.get("type") == "server" and e["event"] == "died"]
    for name, info in servers.items():
        mine = by_server.get(name, [])
        info["requests"] = sum(1 for r in mine if r.get("outcome") == "ok")
        info["errors"] = sum(1 for r in mine if r.get("outcome") == "error" and not r.get("expected_error"))
        info["host_hit_tokens"] = sum(r.get("host", 0) for r in mine if r.get("outcome") == "ok")
        info["starts"] = sum(1 for e in events if e.get("type") == "server" and e["server"] == name
                             and e["event"] == "ready")
        info["crashes"] = sum(1 for e in crashes if e["server"] == name)
        ready = [e for e in events if e.get("type") == "server" and e["server"] == name and e["event"] == "ready"]
        info["weights_redrawn"] = ready[0].get("weights_redrawn") if ready else None
        info["kvcached_lines"] = ready[0].get("kvcached_lines") if ready else None
        later = [r for r in mine if r.get("generation", 1) > 1 and r.get("outcome") == "ok"]
        if later:
            info["answers_after_restart"] = {"ok": len(later), "differ": sum(r.get("match") is False for r in later),
                                             "checked": sum("match" in r for r in later)}
    samples = [e for e in events if e.get("type") == "sample"]
    phases = {e["phase"]: e for e in events if e.get("type") == "phase" and e["event"] == "end"}
    # the budget holds from when it is set to the shared phase's end (the rejoin is after it)
    budget_set = next((e.get("t", 0) for e in events if e.get("type") == "budget"), float("inf"))
    budget_end = phases.get("shared", {}).get("t", float("inf"))
    budget_samples = [s for s in samples if budget_set <= s.get("t", 0) <= budget_end]
    budget = config.get("budget_bytes") or 0
    min_bytes = config.get("reclaim_min_bytes", 1)
    if not (budget_samples and budget):
        moved = {"count": 0, "bytes": 0, "pairs": {}}
    elif config.get("budget_mode", "arbiter") == "arbiter":   # the first runs' journals name no mode
        moved = reclaims(budget_samples, min_bytes)
    else:
        moved = moves(budget_samples, budget, min_bytes)
    shared = by_role.get("shared", [])
    begun = {e["phase"]: e for e in events if e.get("type") == "phase" and e["event"] == "begin"}
    shared_s = None
    if "shared" in begun:
        end = phases.get("shared", {}).get("t") or max((e.get("t", 0) for e in events), default=0)
        shared_s = round(end - begun["shared"]["t"], 1)
    verdict = oracle(events)
    report = {
        "duration_s": shared_s,
        "config": config,
        "servers": list(servers.values()),
        "requests": sum(1 for r in shared if r.get("outcome") == "ok"),
        "aborted_on_purpose": sum(1 for r in shared if r.get("outcome") == "aborted"),
        "errors": sum(1 for r in shared if r.get("outcome") == "error" and not r.get("expected_error")),
        # the other loads' failures (the reference loads, the warm-up, a restarted server's rejoin) fail the run too
        "errors_other_roles": {role: n for role in ("ref-native", "ref-kvcached", "warmup", "rejoin")
                               if (n := sum(1 for r in by_role.get(role, [])
                                            if r.get("outcome") == "error" and not r.get("expected_error")))},
        "solo_ran": "solo" in begun,
        "lost_to_faults": sum(1 for r in shared if r.get("outcome") == "error" and r.get("expected_error")),
        "host_hit_tokens": sum(r.get("host", 0) for r in shared if r.get("outcome") == "ok"),
        "mismatches": verdict["mismatches"],
        "crashes": len(crashes),
        "reclaims": moved["count"],
        "reclaimed_bytes": moved["bytes"],
        "reclaim_pairs": moved["pairs"],
        "faults": [e for e in events if e.get("type") == "fault"],
        "ballast_exited": [e["what"] for e in events if e.get("type") == "ballast" and e.get("event") == "exited"],
        "latency": {role: latency(by_role[role]) for role in ("shared", "ref-native", "ref-kvcached")
                    if role in by_role},
        "oracle": verdict,
        "counters": counter_summary(samples),
        "budget": budget_use(budget_samples, budget),
        "finished": any(e.get("type") == "finish" for e in events),
        "harness_failures": [e["what"] for e in events if e.get("type") == "note"
                             and str(e.get("what", "")).startswith("the harness failed: ")],
    }
    ops = [e for e in events if e.get("type") == "sgl_kernel_ops"]
    if ops:
        report["sgl_kernel_ops"] = {k: v for k, v in ops[-1].items() if k not in ("type", "t")}
    env = [e for e in events if e.get("type") == "environment" and "error" not in e]
    if env:   # the GPU and the versions the servers ran on (a result's summary reads them)
        report["environment"] = {k: v for k, v in env[-1].items() if k not in ("type", "t")}
    report["problems"] = problems(report)
    report["result"] = "pass" if not report["problems"] and report["finished"] else \
        ("fail" if report["problems"] else "incomplete")
    return report


def counter_summary(samples: list[dict]) -> dict:
    """Per instance: samples, and the least and most bytes used and limits seen."""
    out: dict[str, dict] = {}
    for s in samples:
        for name, c in s["instances"].items():
            if not c.get("live", True):
                continue
            o = out.setdefault(name, {"samples": 0, "used_min": c["used"], "used_max": c["used"],
                                      "limit_min": c["limit"], "limit_max": c["limit"]})
            o["samples"] += 1
            o["used_min"], o["used_max"] = min(o["used_min"], c["used"]), max(o["used_max"], c["used"])
            o["limit_min"], o["limit_max"] = min(o["limit_min"], c["limit"]), max(o["limit_max"], c["limit"])
    return out


def budget_use(samples: list[dict], budget: int) -> dict:
    """How well the shared instances kept to the budget: the most they mapped together
    (pages in use and in reserve) and the share of samples above the budget. kvcached
    lowers a limit only once the pages in use fit under it, so a budget can be overrun."""
    from harness.soak.kvc import mapped, under_budget
    totals = [sum(mapped(c) for c in s["instances"].values() if under_budget(c)) for s in samples]
    over = sum(1 for t in totals if budget and t > budget)
    return {"bytes": budget, "mapped_max_bytes": max(totals, default=0),
            "over_budget_share": round(over / len(totals), 3) if totals else 0.0}


# Fixed mode: the share of samples in which the shared servers may map more than the budget
# together (memory torch's cache gave back after a flush, until the server needs it again)
# before the run fails.
OVER_BUDGET = 0.2


def problems(report: dict) -> list[str]:
    """What fails the run."""
    out = []
    if report["mismatches"]:
        kinds = report["oracle"].get("kinds") or {}
        out.append(f"{report['mismatches']} answers differ from the solo reference "
                   f"({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()) if k != 'noise')})")
    out += report.get("harness_failures") or []
    if report["crashes"]:
        out.append(f"{report['crashes']} server(s) died without being killed")
    if not report["requests"]:
        out.append("no request of the shared phase was answered")
    elif not report["host_hit_tokens"]:
        out.append("no shared answer had host-hit tokens: nothing came back from host")
    if report["errors"]:
        out.append(f"{report['errors']} shared requests failed (not counting those lost to a kill)")
    for role, n in sorted((report.get("errors_other_roles") or {}).items()):
        out.append(f"{n} {role} requests failed (not counting those lost to a kill)")
    if report.get("solo_ran"):
        have = report["oracle"].get("references_per_model") or {}
        for model, n in sorted((report["config"].get("catalogue_prompts") or {}).items()):
            if have.get(model, 0) < n:
                out.append(f"{model}: {n - have.get(model, 0)} of {n} catalogue prompts have no solo reference "
                           "(their answers go unchecked)")
    config = report["config"]
    held = config.get("ballast") or {"error": "not started"}
    if config.get("budget_mode") == "fixed" and config.get("budget_bytes") and "error" in held:
        out.append(f"the ballast held nothing ({held['error']}): the GPU did not hold the servers to the budget")
    elif report.get("ballast_exited"):
        out.append(f"{report['ballast_exited'][0]}: the GPU did not hold the servers to the budget to the end")
    elif config.get("budget_mode") == "fixed" and (report.get("budget") or {}).get("over_budget_share", 0) > OVER_BUDGET:
        out.append(f"the servers mapped more than the budget in {report['budget']['over_budget_share']:.0%} of the "
                   "samples: the GPU did not hold them to it, and a reclaim then proves nothing")
    elif config.get("budget_bytes") and not report["reclaims"]:
        out.append("no reclaim seen in kvcached's counters: no instance took pages another gave back" +
                   (" while the budget was full" if config.get("budget_mode") == "fixed" else ""))
    for f in report["faults"]:
        if f.get("ok") is False:
            out.append(f"fault {f['kind']} on {f.get('server')}: {f.get('why', 'did not go as expected')}")
    checked = report["oracle"]["checked"]
    for s in report["servers"]:
        name = s["server"]
        if s.get("role") == "shared" and not checked.get(name):
            out.append(f"{name}: no answer checked against the oracle")
        if s.get("role") == "shared" and name not in report["counters"]:
            out.append(f"{name}: no kvcached counters found (KVCACHED_IPC_NAME {s.get('ipc_name')})")
        if s.get("kvcached_lines") is not None and bool(s["kvcached_lines"]) != bool(s.get("kvcached")):
            out.append(f"{name}: kvcached {'on' if s.get('kvcached') else 'off'}, but its log has "
                       f"{s['kvcached_lines']} kvcached allocation lines")
        if s.get("weights_redrawn") is not None and not all(s["weights_redrawn"] or [0]):
            out.append(f"{name}: dummy weights at SGLang's 1e-3 scale (the trained-scale plugin did not run): "
                       "the KV cache would not move any answer")
    return out


# --- the results table ---------------------------------------------------------------

TABLE_HEAD = ("| run | result | shared s | servers (model: pool, kvcached) | requests | host-hit tokens "
              "| mismatches (noise) | crashes | reclaims | faults | TTFT host-hit p50 / p99 ms: shared "
              "| native | kvcached unshared |")


def table_row(name: str, report: dict) -> str:
    lat = report.get("latency", {})
    ttft = lambda role: (f"{lat[role]['ttft_host_hit_p50_ms']} / {lat[role]['ttft_host_hit_p99_ms']}"
                         if role in lat and lat[role].get("ttft_host_hit_p50_ms") is not None else "-")
    servers = ", ".join(f"{s['model']}: {s['pool']}, {'on' if s['kvcached'] else 'off'}"
                        for s in report["servers"] if s.get("role") == "shared")
    faults = "; ".join(f"{f['kind']}{'' if f.get('ok', True) else ' (failed)'}" for f in report["faults"]) or "-"
    return "| " + " | ".join([
        name, report["result"], str(report["duration_s"]), servers, str(report["requests"]),
        str(report["host_hit_tokens"]), f"{report['mismatches']} ({report['oracle']['noise']})",
        str(report["crashes"]), str(report["reclaims"]), faults, ttft("shared"), ttft("ref-native"),
        ttft("ref-kvcached")]) + " |"


def table(reports: dict[str, dict]) -> str:
    lines = [TABLE_HEAD, "|" + "---|" * TABLE_HEAD.count(" | ") + "---|"]
    lines += [table_row(name, rep) for name, rep in reports.items()]
    return "\n".join(lines)
