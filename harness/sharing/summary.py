"""A sharing run's report, computed from its journal alone (so a run cut short is reported
from what it wrote, and `--rebuild` gives the same report again), its markdown, its plot
and the summary `harness.results add sharing` keeps.

Per phase, variant, round and model (and in total, every model's requests pooled):
  request and output-token throughput: answered requests (tokens) / the phase's duration,
      its start to its last answer (the same for every model of the phase);
  TTFT mean, p50, p99 and ITL p50 (ms; percentiles interpolated linearly, as numpy's and
      bench_serving's), of answered requests;
  within SLO: the share of the phase's requests answered with TTFT <= slo_ms (an error or
      a cut request counts as a miss);
  device / host hit tokens: the sums of each answer's meta_info.cached_tokens_details;
  retractions: the sum of each answer's meta_info.num_retractions (the server logs'
      "#retracted_reqs" over each slot are reported beside them).
Across rounds, each value's median and spread (min, max), and its ratio to (b)'s value of
the same round, with the ratios' median and spread. Targets (never judged in a timed
test): under shifting load (bursts, waves) (d)'s total request throughput above, and its
TTFT p99 below, every other variant's, and its TTFT p99 at most half of (b)'s; under even
load, (d)'s request throughput at least 0.95 of (b)'s. A target is met when the median
ratio meets it, "within spread" when only some round's does, short when none does; one
round is judged alone and says so. The correctness sample: each of (d)'s answers to the
sample equals the reference's (the native server of (b), solo) or is a mismatch.
"""
from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

from harness.sharing.plan import BASELINE, PRODUCT, SHIFTING, VARIANTS

# (key, what the report calls it, which way is better)
METRICS = (("request_throughput", "req/s", "higher"), ("output_throughput", "out tok/s", "higher"),
           ("ttft_mean_ms", "TTFT mean ms", "lower"), ("ttft_p50_ms", "TTFT p50 ms", "lower"),
           ("ttft_p99_ms", "TTFT p99 ms", "lower"), ("itl_p50_ms", "ITL p50 ms", "lower"),
           ("slo_share", "within SLO", "higher"), ("device_hit_tokens", "device hits", "higher"),
           ("host_hit_tokens", "host hits", "higher"), ("retractions", "retractions", "lower"))
SERIES_BINS = 20
DIGITS = {"request_throughput": 2, "output_throughput": 2, "device_hit_tokens": 0, "host_hit_tokens": 0,
          "retractions": 0}


def percentile(values: list[float], q: float) -> float | None:
    """Linearly interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    f = math.floor(k)
    c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)


def metrics(requests: list[dict], duration: float, slo_ms: float) -> dict:
    """One group's numbers (a model's, or every model's, in one phase of one slot)."""
    ok = [r for r in requests if r.get("outcome") == "ok"]
    ttft = [1000 * r["ttft"] for r in ok]
    itl = [x for r in ok for x in r.get("itl_ms") or []]
    total = lambda key: sum(int(r.get(key) or 0) for r in ok)
    return {"sent": len(requests), "answered": len(ok), "errors": sum(r.get("outcome") == "error" for r in requests),
            "cut": sum(r.get("outcome") == "cut" for r in requests), "duration_s": duration,
            "request_throughput": len(ok) / duration if duration else None,
            "output_throughput": total("out") / duration if duration else None,
            "input_tokens": sum(int(r.get("in") or 0) for r in ok),
            "ttft_mean_ms": statistics.fmean(ttft) if ttft else None, "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99), "itl_p50_ms": percentile(itl, 50),
            "slo_share": sum(t <= slo_ms for t in ttft) / len(requests) if requests else None,
            "device_hit_tokens": total("device"), "host_hit_tokens": total("host"), "cached_tokens": total("cached"),
            "retractions": total("retractions")}


def across(values: list, base: list) -> dict:
    """A metric over rounds: its values and their median and spread, and its ratios to the
    baseline's value of the same round with theirs."""
    have = [x for x in values if x is not None]
    ratios = [x / b if x is not None and b else None for x, b in zip(values, base)]
    rs = [x for x in ratios if x is not None]
    return {"values": values, "median": statistics.median(have) if have else None,
            "min": min(have, default=None), "max": max(have, default=None),
            "ratios": ratios, "ratio": statistics.median(rs) if rs else None,
            "ratio_min": min(rs, default=None), "ratio_max": max(rs, default=None)}


def judge(ratios: list, op: str, bound: float) -> str:
    """A target over the per-round ratios: 'met' (the median meets it), 'within spread'
    (some round does), 'short' (none does); one round alone: 'met (one round)' or 'short
    (one round)'."""
    measured = [x for x in ratios if x is not None]
    if not measured:
        return "not measured"
    ok = {">": lambda x: x > bound, ">=": lambda x: x >= bound, "<": lambda x: x < bound,
          "<=": lambda x: x <= bound}[op]
    if len(measured) == 1:
        return ("met" if ok(measured[0]) else "short") + " (one round)"
    if ok(statistics.median(measured)):
        return "met"
    return "within spread" if any(ok(x) for x in measured) else "short"


# ---- server logs -------------------------------------------------------------------------

POOL = re.compile(r"max_total_num_tokens=(\d+)")
HOST_POOL = re.compile(r"host pool: (\d+) tokens, ([\d.]+) GB host memory")
RETRACTED = re.compile(r"#retracted_reqs: (\d+)")
CACHED_CAP = re.compile(r"evictable size capped at (\d+) tokens")     # kvcached's KVCACHED_MAX_CACHED_TOKENS


def log_facts(text: str) -> dict:
    """What a server's log says of its pools: the device pool's tokens (SGLang's
    max_total_num_tokens line; None where absent), its host pools' GB (summed: a hybrid's
    KV and Mamba host pools; None with HiCache off) and kvcached's cap on cached tokens
    (its patch's line; None where it set none)."""
    pool = POOL.search(text)
    hosts = HOST_POOL.findall(text)
    cap = CACHED_CAP.search(text)
    return {"pool_tokens": int(pool.group(1)) if pool else None,
            "host_gb": round(sum(float(gb) for _, gb in hosts), 3) if hosts else None,
            "cached_cap": int(cap.group(1)) if cap else None}


def log_retractions(text: str) -> int:
    """Requests the scheduler retracted ("KV cache pool is full. Retract requests.
    #retracted_reqs: N"), summed over the text."""
    return sum(int(n) for n in RETRACTED.findall(text))


# ---- the report --------------------------------------------------------------------------

def _series(requests: list[dict], phase_s: float) -> list:
    """TTFT over the phase: [bin middle s, requests sent in it, p50 ms, max ms] a bin."""
    width = phase_s / SERIES_BINS
    out = []
    for i in range(SERIES_BINS):
        mine = [1000 * r["ttft"] for r in requests if r.get("outcome") == "ok" and r.get("sent") is not None
                and i * width <= r["sent"] < (i + 1) * width]
        mine_sent = [r for r in requests if r.get("sent") is not None and i * width <= r["sent"] < (i + 1) * width]
        out.append([round((i + 0.5) * width, 3), len(mine_sent), percentile(mine, 50), max(mine, default=None)])
    return out


def summarize(events: list[dict]) -> dict:
    """The report of a journal (whole or cut short)."""
    runs = [e for e in events if e.get("type") == "run"]
    if not runs:
        raise ValueError("no run event: not a sharing journal")
    run = runs[0]
    config = run["config"]
    plan, labels = config["plan"], config["labels"]
    variants, rounds, slo = plan["variants"], plan["rounds"], plan["slo_ms"]
    load = [e for e in events if e.get("type") == "request" and e.get("role") == "load"]
    by_slot_phase: dict[tuple, list] = {}
    for e in load:
        by_slot_phase.setdefault((e["round"], e["variant"], e["phase"]), []).append(e)
    ended = {(e["round"], e["variant"], e["phase"]): e for e in events if e.get("type") == "phase"}

    phases = {}
    for phase in plan["phases"]:
        per_variant = {}
        for v in variants:
            rounds_out = []
            for r in range(rounds):
                end = ended.get((r, v, phase))
                if end is None:
                    rounds_out.append(None)
                    continue
                reqs = by_slot_phase.get((r, v, phase), [])
                rounds_out.append({"total": metrics(reqs, end["duration"], slo),
                                   "models": {m: metrics([x for x in reqs if x["model"] == m], end["duration"], slo)
                                              for m in labels}})
            per_variant[v] = {"rounds": rounds_out}
        base = per_variant.get(BASELINE, {"rounds": [None] * rounds})["rounds"]
        for v, entry in per_variant.items():
            total = lambda rs, k: [x["total"][k] if x else None for x in rs]
            model = lambda rs, m, k: [x["models"][m][k] if x else None for x in rs]
            entry["total"] = {k: across(total(entry["rounds"], k), total(base, k)) for k, _, _ in METRICS}
            entry["models"] = {m: {k: across(model(entry["rounds"], m, k), model(base, m, k)) for k, _, _ in METRICS}
                               for m in labels}
            first = next((r for r in range(rounds) if entry["rounds"][r] is not None), None)
            entry["ttft_series"] = {m: _series([x for x in by_slot_phase.get((first, v, phase), []) if x["model"] == m],
                                               plan["phase_s"]) for m in labels} if first is not None else {}
        phases[phase] = per_variant

    report = {"tool": "sharing", "started": run.get("started"), "argv": run.get("argv") or [],
              "environment": run.get("environment") or {}, "patches": run.get("patches"), "config": config,
              "servers": servers_of(events), "slots": [e for e in events if e.get("type") == "slot"],
              "phases": phases, "targets": targets(phases, variants), "correctness": correctness(events),
              "complete": any(e.get("type") == "done" for e in events),
              "interrupted": any(e.get("type") == "interrupted" for e in events)}
    report["problems"] = problems(report)
    return report


def servers_of(events: list[dict]) -> dict:
    """Each server's last state, with the pools its log reports beside the planned ones."""
    out = {}
    for e in events:
        if e.get("type") == "server":
            out[e["label"]] = {k: v for k, v in e.items() if k not in ("type", "t")}
    return out


def targets(phases: dict, variants: list[str]) -> list[dict]:
    """The issue's targets for (d), each with its per-round ratios and verdict."""
    rows = []
    if PRODUCT not in variants:
        return rows

    def row(phase, against, key, op, bound, what):
        d = phases[phase][PRODUCT]["total"][key]["values"]
        x = phases[phase][against]["total"][key]["values"]
        ratios = [a / b if a is not None and b else None for a, b in zip(d, x)]
        rs = [r for r in ratios if r is not None]
        rows.append({"phase": phase, "target": what, "against": against, "metric": key, "op": op, "bound": bound,
                     "ratios": ratios, "ratio": statistics.median(rs) if rs else None,
                     "min": min(rs, default=None), "max": max(rs, default=None), "verdict": judge(ratios, op, bound)})

    for phase in phases:
        if phase in SHIFTING:
            for other in (v for v in variants if v != PRODUCT):
                row(phase, other, "request_throughput", ">", 1.0, f"total req/s above ({VARIANTS[other].letter})'s")
                row(phase, other, "ttft_p99_ms", "<", 1.0, f"TTFT p99 below ({VARIANTS[other].letter})'s")
            row(phase, BASELINE, "ttft_p99_ms", "<=", 0.5, "TTFT p99 at most half of (b)'s")
        elif phase == "even":
            row(phase, BASELINE, "request_throughput", ">=", 0.95, "req/s at least 0.95 of (b)'s")
    return rows


def first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def correctness(events: list[dict]) -> dict:
    """(d)'s sample answers against the reference's (the same prompts, solo, on (b)'s native server)."""
    reference = {(e["model"], e["key"]): e["output_ids"] for e in events
                 if e.get("type") == "request" and e.get("role") == "reference" and e.get("outcome") == "ok"}
    checks = [e for e in events if e.get("type") == "request" and e.get("role") == "sample"]
    mismatches, unchecked, errors = [], 0, 0
    for e in checks:
        if e.get("outcome") != "ok":
            errors += 1
            continue
        ref = reference.get((e["model"], e["key"]))
        if ref is None:
            unchecked += 1
        elif e["output_ids"] != ref:
            mismatches.append({"round": e["round"], "model": e["model"], "key": e["key"],
                               "first_difference": first_difference(e["output_ids"], ref),
                               "device": e.get("device", 0), "host": e.get("host", 0)})
    matched = len(checks) - errors - unchecked - len(mismatches)
    verdict = ("not run" if not checks else "MISMATCH" if mismatches
               else "incomplete" if errors or unchecked else "pass")
    ok = [e for e in checks if e.get("outcome") == "ok"]
    return {"reference": BASELINE, "reference_answers": len(reference), "checked": len(checks), "matched": matched,
            "mismatches": mismatches, "errors": errors, "unchecked": unchecked, "verdict": verdict,
            "device_hit_tokens": sum(e.get("device", 0) for e in ok), "host_hit_tokens": sum(e.get("host", 0) for e in ok)}


def problems(report: dict) -> list[str]:
    """What makes the run incomplete, its budgets unequal or its answers wrong."""
    out, host = [], {}
    for label, s in report["servers"].items():
        v = VARIANTS[s["variant"]]
        if s.get("event") != "ready":
            out.append(f"{label}: server {s.get('why') or s.get('event')}: {s.get('error') or 'no error line in its log'}")
            continue
        if s.get("pool_tokens") != s.get("planned_tokens"):
            out.append(f"{label}: its device pool is {s.get('pool_tokens')} tokens, planned {s.get('planned_tokens')}: "
                       "the budgets are not as planned")
        if v.hicache:
            host.setdefault(s["model"], {})[s["variant"]] = s.get("host_gb")
            if s.get("host_gb") is None:
                out.append(f"{label}: no host pool in its log")
        if v.kvcached and s.get("cached_cap") != s.get("planned_cached_tokens"):
            out.append(f"{label}: kvcached's cap on cached tokens is {s.get('cached_cap')} in its log, planned "
                       f"{s.get('planned_cached_tokens')}: an idle model may keep its pages")
        if bool(s.get("kvcached_lines")) != v.kvcached:
            out.append(f"{label}: kvcached {'on' if v.kvcached else 'off'}, but its log has "
                       f"{len(s.get('kvcached_lines') or [])} kvcached allocation lines")
        if not s.get("weights_redrawn"):
            out.append(f"{label}: no trained-scale weights line in its log (harness/compare/plugin not loaded)")
    for model, gbs in host.items():
        if len(set(gbs.values())) > 1:
            out.append(f"{model}: host pools differ between variants ({gbs}): the host budgets are not equal")
    for e in report["slots"]:
        if e.get("status") != "done":
            out.append(f"round {e['round'] + 1} {e['variant']}: {e.get('why') or e.get('status')}")
        elif e.get("ballast_exited"):
            out.append(f"round {e['round'] + 1} {e['variant']}: {e['ballast_exited']}: its KV budget was not held")
        elif e.get("flush_failed"):
            out.append(f"round {e['round'] + 1} {e['variant']}: caches not flushed before it: "
                       + ", ".join(e["flush_failed"]))
    for phase, per_variant in report["phases"].items():
        for v, entry in per_variant.items():
            for r, x in enumerate(entry["rounds"]):
                if x and (x["total"]["errors"] or x["total"]["cut"]):
                    out.append(f"round {r + 1} {v} {phase}: {x['total']['errors']} requests failed, "
                               f"{x['total']['cut']} cut after the drain")
    c = report["correctness"]
    if c["verdict"] == "MISMATCH":
        out.append(f"CORRECTNESS: {len(c['mismatches'])} of (d)'s sample answers differ from the native reference")
    elif c["verdict"] == "incomplete":
        out.append(f"correctness sample: {c['errors']} failed, {c['unchecked']} without a reference answer")
    if report["interrupted"]:
        out.append("the run was interrupted")
    elif not report["complete"]:
        out.append("the journal ends before the run's end (cut short): the report holds what it measured")
    return out


def load(path: str | Path) -> dict:
    """A report: report.json as written, or made again from a journal (journal.jsonl);
    either may be gzipped."""
    from harness.results import raw_json

    data = raw_json(Path(path))
    if isinstance(data, list):
        return summarize([e for e in data if isinstance(e, dict)])
    if not isinstance(data, dict) or data.get("tool") != "sharing":
        raise ValueError("not a sharing report")
    return data


def summary(report: dict) -> dict:
    """What a committed summary keeps (results/): the plan and budgets, the servers' pools,
    the slots, every phase's per-round values and ratios (6 significant digits) and
    request counts, the targets, the correctness sample, the TTFT series and the problems;
    not the journal's requests. render() and plot() take it as they take the report."""
    c = report["config"]
    keep_server = ("variant", "model", "event", "planned_tokens", "pool_tokens", "planned_host_gb", "host_gb",
                   "planned_cached_tokens", "cached_cap", "start_s")
    return {"config": {k: c.get(k) for k in ("plan", "labels", "budgets", "totals", "server_flags", "env")},
            "environment": {"versions": (report.get("environment") or {}).get("versions"),
                            "gpus": (report.get("environment") or {}).get("gpus")},
            "servers": {k: {f: s.get(f) for f in keep_server} for k, s in report["servers"].items()},
            "slots": [{k: e.get(k) for k in ("round", "position", "variant", "status", "why", "seconds",
                                             "log_retractions", "ballast")} for e in report["slots"]],
            "phases": {phase: {v: {"rounds": [{k: x["total"][k] for k in COUNTS} if x else None for x in e["rounds"]],
                                   **{k: significant(e[k]) for k in ("total", "models", "ttft_series")}}
                               for v, e in per_variant.items()} for phase, per_variant in report["phases"].items()},
            "targets": significant(report["targets"]), "correctness": report["correctness"],
            "complete": report["complete"], "problems": report["problems"]}


COUNTS = ("sent", "answered", "errors", "cut", "duration_s")


def significant(value, digits: int = 6):
    """Floats to `digits` significant digits (what a committed summary keeps)."""
    if isinstance(value, float) and math.isfinite(value) and value:
        return round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))
    if isinstance(value, dict):
        return {k: significant(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [significant(v, digits) for v in value]
    return value


# ---- markdown ----------------------------------------------------------------------------

def fmt(x, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.{digits}f}"


def cell(stat: dict, digits: int = 1, ratio: bool = False) -> str:
    """median (min-max) of a metric's values, or of its ratios."""
    mid, lo, hi = (stat["ratio"], stat["ratio_min"], stat["ratio_max"]) if ratio else \
        (stat["median"], stat["min"], stat["max"])
    d = 2 if ratio else digits
    if mid is None:
        return "-"
    if lo == hi:
        return fmt(mid, d)
    return f"{fmt(mid, d)} ({fmt(lo, d)}-{fmt(hi, d)})"


def _share(x) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def render(data: dict) -> str:
    """The markdown of a report's summary (a report is summarized first, so that a run's
    summary.md reads as the committed summary renders)."""
    if "argv" in data:
        data = summary(data)
    c = data["config"]
    plan, labels = c["plan"], c["labels"]
    variants = plan["variants"]
    name = lambda v: f"({VARIANTS[v].letter}) {v}"
    lines = [f"# Sharing one GPU: {', '.join(labels)}; {len(variants)} ways to split it", "",
             f"{len(labels)} SGLang servers a variant on one GPU, {plan['rounds']} rounds, each variant once a round, "
             f"the order rotated; phases {', '.join(plan['phases'])} of {plan['phase_s']:g} s of arrivals each "
             f"(the even-load control in the first {plan['even_rounds']} rounds). KV budget of a variant "
             f"{plan['kv_budget_gib']:g} GiB on the GPU; --hicache-size {plan['host_gb']:g} GB a server with HiCache. "
             f"Cells: median over rounds (min-max). Hit tokens: each answer's meta_info.cached_tokens_details; "
             f"retractions: each answer's meta_info.num_retractions (the server logs' in their own table). "
             f"Within SLO: TTFT <= {plan['slo_ms']:g} ms, of the requests sent."]
    if data.get("targets"):
        lines += ["", "## Targets ((d) against each variant, total of every model)", "",
                  "| phase | target | ratio (min-max) | verdict |", "|---|---|---|---|"]
        for t in data["targets"]:
            stat = {"ratio": t["ratio"], "ratio_min": t["min"], "ratio_max": t["max"]}
            lines.append(f"| {t['phase']} | {t['target']} | {cell(stat, ratio=True)} | {t['verdict']} |")
    cor = data["correctness"]
    lines += ["", "## Correctness sample", ""]
    if cor["verdict"] == "MISMATCH":
        lines.append(f"**MISMATCH: {len(cor['mismatches'])} of {cor['checked']} of (d)'s sample answers differ from "
                     "the native reference's.**")
        lines += [f"- round {m['round'] + 1} {m['model']} {m['key']}: first differs at token {m['first_difference']} "
                  f"(hits: device {m['device']}, host {m['host']})" for m in cor["mismatches"][:10]]
    else:
        lines.append(f"{cor['verdict']}: {cor['matched']} of {cor['checked']} of (d)'s answers (greedy, solo, the "
                     f"other models under load) equal the native reference's (b, solo); their hits: device "
                     f"{fmt(cor['device_hit_tokens'])}, host {fmt(cor['host_hit_tokens'])} tokens.")
    lines += ["", "## Budgets", "", "| variant | model | --max-total-tokens (server's) | KV GiB alone | "
              "--hicache-size GB (server's) | KVCACHED_MAX_CACHED_TOKENS (server's) |", "|---|---|---|---|---|---|"]
    servers = data.get("servers") or {}
    for v in variants:
        for label in labels:
            b = c["budgets"][f"{v}/{label}"]
            s = servers.get(f"{v}/{label}", {})
            lines.append(f"| {name(v)} | {label} | {fmt(b['device_tokens'])} ({fmt(s.get('pool_tokens'))}) | "
                         f"{b['kv_bytes'] / 2 ** 30:.2f} | {fmt(b['host_gb'], 2)} ({fmt(s.get('host_gb'), 2)}) | "
                         f"{fmt(b['cached_tokens'])} ({fmt(s.get('cached_cap'))}) |")
    lines += ["", "Every variant's KV memory: " + ", ".join(
        f"({VARIANTS[v].letter}) {t['kv_bytes'] / 2 ** 30:.3f} GiB" for v, t in c["totals"].items())
        + "; host: " + ", ".join(f"({VARIANTS[v].letter}) {t['host_gb']:g} GB" for v, t in c["totals"].items()) + "."]
    for phase, per_variant in data["phases"].items():
        lines += ["", f"## {phase}", "", "Total:", "",
                  "| variant | " + " | ".join(label for _, label, _ in METRICS) + " |", "|---|" + "---|" * len(METRICS)]
        for v, e in per_variant.items():
            lines.append(f"| {name(v)} | " + " | ".join(
                _share(e["total"][k]["median"]) if k == "slo_share" else cell(e["total"][k], DIGITS.get(k, 1))
                for k, _, _ in METRICS) + " |")
        lines += ["", "Ratios to (b), total:", "",
                  "| variant | " + " | ".join(label for _, label, _ in METRICS) + " |", "|---|" + "---|" * len(METRICS)]
        for v, e in per_variant.items():
            if v != BASELINE:
                lines.append(f"| {name(v)} | " + " | ".join(cell(e["total"][k], ratio=True) for k, _, _ in METRICS)
                             + " |")
        lines += ["", "Per round, total:", "", "| variant | round | req/s | TTFT p99 ms | within SLO | host hits |",
                  "|---|---|---|---|---|---|"]
        for v, e in per_variant.items():
            t = e["total"]
            for r, x in enumerate(e["rounds"]):
                if x:
                    lines.append(f"| {name(v)} | {r + 1} | {fmt(t['request_throughput']['values'][r], 2)} | "
                                 f"{fmt(t['ttft_p99_ms']['values'][r])} | {_share(t['slo_share']['values'][r])} | "
                                 f"{fmt(t['host_hit_tokens']['values'][r])} |")
        lines += ["", "Per model:", "", "| model | variant | req/s | TTFT p50 ms | TTFT p99 ms | within SLO | "
                  "device / host hits | retractions |", "|---|---|---|---|---|---|---|---|"]
        for label in labels:
            for v, e in per_variant.items():
                m = e["models"][label]
                lines.append(f"| {label} | {name(v)} | {cell(m['request_throughput'], 2)} | {cell(m['ttft_p50_ms'])} | "
                             f"{cell(m['ttft_p99_ms'])} | {_share(m['slo_share']['median'])} | "
                             f"{cell(m['device_hit_tokens'], 0)} / {cell(m['host_hit_tokens'], 0)} | "
                             f"{cell(m['retractions'], 0)} |")
    slots = [s for s in data["slots"] if s.get("log_retractions") is not None]
    if slots:
        lines += ["", "## Retractions in the server logs (each slot, every phase and the sample)", "",
                  "| round | variant | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
        lines += [f"| {s['round'] + 1} | {name(s['variant'])} | "
                  + " | ".join(fmt(s["log_retractions"].get(label)) for label in labels) + " |" for s in slots]
    if data.get("problems"):
        lines += ["", "## Problems", ""] + [f"- {p}" for p in data["problems"]]
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> bool:
    """TTFT over each phase, a panel per phase and variant, a line per model (p50 of each
    bin, its maximum dotted); False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    phases = data["phases"]
    variants = data["config"]["plan"]["variants"]
    fig, axes = plt.subplots(len(phases), len(variants), figsize=(4 * len(variants), 3 * len(phases)),
                             squeeze=False, sharey=True)
    for i, (phase, per_variant) in enumerate(phases.items()):
        for j, v in enumerate(variants):
            ax = axes[i][j]
            for k, (label, series) in enumerate(per_variant[v].get("ttft_series", {}).items()):
                xs = [b[0] for b in series if b[2] is not None]
                line, = ax.plot(xs, [b[2] for b in series if b[2] is not None], label=label)
                ax.plot(xs, [b[3] for b in series if b[2] is not None], linestyle=":", color=line.get_color())
            ax.set_title(f"{phase}: ({VARIANTS[v].letter}) {v}", fontsize=9)
            ax.set_xlabel("s into the phase (sent)")
            if j == 0:
                ax.set_ylabel("TTFT ms (p50; max dotted)")
            if ax.get_legend_handles_labels()[0]:      # a slot not run has no line
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
