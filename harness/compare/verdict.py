"""Judging server runs: what a response says, how a run compares to native, the report.

A run (one row, see matrix.py) is recorded as a dict: its outcome ("served", "died",
"not ready"), the error line its log ends with, kvcached's allocation lines found in its
log, timings, and the summarized responses of each pass. `verdict` turns a run and its
group's native run into a result and a list of problems; a problem fails the comparison.
A shared-store row's run is its writer's, with pass 2 from its reader, whose own record
(log, tag, kvcached lines) is under `reader`; `shared_problems` judges what the pair adds.
"""
from __future__ import annotations

import re

# kvcached 0.1.6 logs one of these when it builds an elastic pool or allocator
KVCACHED_SERVED = re.compile(
    r"VirtualKV Cache is allocated|Elastic MambaPool|Elastic\w*Allocator in use")
# what plugin/trained_scale_weights.py prints, once per rank, when it draws a dummy
# model's weights: "trained-scale dummy weights drawn: <count> tensors (tp rank <r>)"
WEIGHTS_REDRAWN = "trained-scale dummy weights drawn"
WEIGHTS_COUNT = re.compile(re.escape(WEIGHTS_REDRAWN) + r": (\d+) tensors")
# how the pristine tree fails where the series fixes it: at the first backup, while serving
PRISTINE_FAILS_SERVING = "died serving"
# the line a Python traceback ends with, e.g. "AttributeError: 'X' object has no attribute 'y'"
ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?[A-Z]\w*(?:Error|Exception)\b.*$")


def summarize(response: dict) -> dict:
    """What the comparison needs from one /generate response."""
    meta = response["meta_info"]
    details = meta.get("cached_tokens_details") or {}   # absent when nothing was cached
    cached = meta.get("cached_tokens", 0)
    host, storage = details.get("host", 0), details.get("storage") or 0
    return {
        "output_ids": response.get("output_ids") or [t[1] for t in meta["output_token_logprobs"]],
        "top_logprobs": [[(entry[1], entry[0]) for entry in position]
                         for position in meta["output_top_logprobs"]],
        "cached_tokens": cached,
        "device_tokens": details.get("device", cached - host - storage),
        "host_tokens": host,
        "storage_tokens": storage,
        # speculative decoding (absent without it): verify steps and accepted draft tokens
        **{key: meta[key] for key in SPEC_KEYS if key in meta},
    }


def scan_log(text: str) -> dict:
    """kvcached's allocation lines, the error lines of a server log (`error`: the first,
    the cause where one process's failure takes the others down), and the tensor counts
    of the trained-scale weights plugin, one per rank that drew them."""
    served, errors = [], []
    for line in text.splitlines():
        if KVCACHED_SERVED.search(line) and line not in served:
            served.append(line.strip())
        stripped = line.strip()
        if ERROR_LINE.match(stripped) and stripped not in errors:
            errors.append(stripped)
    return {"kvcached_lines": served[:6], "error": errors[0] if errors else "", "errors": errors[:6],
            "weights_redrawn": [int(m.group(1)) for m in WEIGHTS_COUNT.finditer(text)]}


HIT_KINDS = ("device_tokens", "host_tokens", "storage_tokens")
# what SGLang's meta_info says of speculative decoding: equal drafts and verifies mean
# the draft model read the same KV (its own pool's and, packed, the target's host copies)
SPEC_KEYS = ("spec_verify_ct", "spec_accepted_drafts")


def compare(native: dict[str, list[dict]], other: dict[str, list[dict]], logprob_tol: float) -> list[str]:
    """Every difference between two runs' passes; empty when they match: outputs (see
    output_differences), device, host and storage hit tokens per prompt, then speculative
    decoding's verify steps and accepted drafts where the runs record them."""
    return output_differences(native, other, logprob_tol) + hit_differences(native, other) \
        + spec_differences(native, other)


def spec_differences(native: dict[str, list[dict]], other: dict[str, list[dict]]) -> list[str]:
    """Prompts whose speculative-decoding counts differ from native's (or are missing on one side)."""
    problems = []
    for name, reference in native.items():
        for i, (a, b) in enumerate(zip(reference, other.get(name, []))):
            for key in SPEC_KEYS:
                if a.get(key) != b.get(key):
                    problems.append(f"{name} prompt {i}: {key} {b.get(key)}, native {a.get(key)}")
    return problems


def hit_differences(native: dict[str, list[dict]], other: dict[str, list[dict]]) -> list[str]:
    """Prompts whose device, host or storage hit tokens differ from native's."""
    problems = []
    for name, reference in native.items():
        for i, (a, b) in enumerate(zip(reference, other.get(name, []))):
            for kind in HIT_KINDS:
                if a[kind] != b[kind]:
                    problems.append(f"{name} prompt {i}: {b[kind]} {kind.replace('_', ' ')}, native {a[kind]}")
    return problems


def output_differences(native: dict[str, list[dict]], other: dict[str, list[dict]], logprob_tol: float) -> list[str]:
    """What a user would see differ: greedy tokens must be equal; each position's top token
    equal and its top-k logprobs within logprob_tol (0: bit-identical)."""
    problems = []
    for name, reference in native.items():
        answers = other.get(name, [])
        if len(reference) != len(answers):
            problems.append(f"{name}: {len(answers)} responses, native {len(reference)}")
            continue
        for i, (a, b) in enumerate(zip(reference, answers)):
            where = f"{name} prompt {i}"
            if a["output_ids"] != b["output_ids"]:
                first = next((j for j, (x, y) in enumerate(zip(a["output_ids"], b["output_ids"])) if x != y),
                             min(len(a["output_ids"]), len(b["output_ids"])))
                problems.append(f"{where}: greedy tokens differ from position {first}")
            for pos, (ta, tb) in enumerate(zip(a["top_logprobs"], b["top_logprobs"])):
                if not ta or not tb or ta[0][0] != tb[0][0]:
                    problems.append(f"{where} position {pos}: top token differs")
                    continue
                da, db = dict(ta), dict(tb)
                if da.keys() != db.keys():
                    problems.append(f"{where} position {pos}: top-{len(ta)} token sets differ")
                    continue
                worst = max(abs(da[t] - db[t]) for t in da)
                if worst > logprob_tol:
                    problems.append(f"{where} position {pos}: top-{len(ta)} logprobs differ by {worst:.3g}")
    return problems


def hit_totals(run: dict) -> dict[str, int]:
    """Hit tokens of pass 2 (the pass whose prefixes left the device), summed over prompts."""
    answers = (run.get("passes") or {}).get("pass2", [])
    return {kind: sum(a[kind] for a in answers) for kind in HIT_KINDS}


def native_problems(run: dict, l3: bool) -> list[str]:
    """A native run must serve, run kvcached-free, and actually reach the tier under test."""
    if run["outcome"] != "served":
        return [f"native run {run['outcome']}: {run.get('error') or 'no error line in its log'}"]
    problems = []
    if run.get("kvcached_lines"):
        problems.append("native run logged kvcached allocations: kvcached was not off")
    hits = hit_totals(run)
    if l3 and not hits["storage_tokens"] and not run.get("shared"):   # a pair: shared_problems says it
        problems.append("native never hit the L3 store: the filler did not push the set out of host memory")
    if not l3 and not hits["host_tokens"]:
        problems.append("native never hit the host cache: the filler did not push the set out of the device")
    if run.get("draft") and not any(SPEC_KEYS[0] in a for answers in (run.get("passes") or {}).values()
                                     for a in answers):
        problems.append("native reports no speculative decoding (no spec_verify_ct in any answer): "
                        "equal counts would prove nothing of the draft")
    return problems


def shared_problems(run: dict) -> list[str]:
    """A served shared-store pair: its reader, which never saw pass 1, must have answered
    from the store the writer filled under the same tag, and run as the writer did
    (kvcached on or off, trained-scale weights)."""
    if not run.get("shared") or run["outcome"] != "served":
        return []
    reader, problems = run.get("reader") or {}, []
    if not hit_totals(run)["storage_tokens"]:
        same = "the same tag" if reader.get("store_tag") == run.get("store_tag") else \
            f"tag {reader.get('store_tag')!r}, the writer {run.get('store_tag')!r}"
        problems.append(f"the reader ({same}) had no storage hit in pass 2: it did not answer from what "
                        "the writer stored")
    if bool(run.get("kvcached")) != bool(reader.get("kvcached_lines")):
        problems.append("the reader's log " + ("has no kvcached allocation" if run.get("kvcached")
                                               else "has kvcached allocations") + ", unlike its variant")
    if run.get("dummy") and sorted(reader.get("weights_redrawn") or []) != sorted(run.get("weights_redrawn") or []):
        problems.append(f"the reader's trained-scale plugin drew {reader.get('weights_redrawn')} tensors, "
                        f"the writer {run.get('weights_redrawn')}")
    return problems


def verdict(expect: str, run: dict, native: dict | None, logprob_tol: float, refusal: str = "") -> tuple[str, list[str]]:
    """(result, problems) of one run against its group's native run.

    expect "match": serves with kvcached and equals native. "fail": the pristine tree with
    kvcached, which must not equal native: it dies (its error line is the result) or
    differs (the first difference is). "refused": startup stops with the refusal message.
    """
    outcome, error = run["outcome"], run.get("error", "")
    if outcome == "skipped":
        return f"not run: {run.get('reason', '')}", []
    if expect == "refused":
        if outcome == "served":
            return "served", [f"expected a refusal at startup ({refusal}), but it served"]
        if refusal and refusal in error:
            return f"refused at startup: {error}", []
        return f"{outcome}: {error}", [f"expected the refusal '{refusal}', got: {error or 'no error line'}"]
    if native is None or native["outcome"] != "served":
        return f"{outcome} (no native run to compare)", ["no served native run in this group"]
    if outcome != "served":
        if expect == "fail" and outcome == PRISTINE_FAILS_SERVING:
            return f"fails as expected: {error or outcome}", []
        why = error or "no error line in its log"
        if expect == "fail":   # it never reached a backup: it shows nothing of what the series fixes
            return f"{outcome}: {why}", [f"pristine row {outcome} ({why}): the failure the series fixes "
                                         "happens at the first backup, while serving"]
        return f"{outcome}: {why}", [f"{outcome}: {why}"]
    problems = [] if run.get("kvcached_lines") else ["no kvcached allocation in its log: kvcached did not serve"]
    if expect == "fail":
        wrong = output_differences(native["passes"], run["passes"], logprob_tol)
        if wrong:
            return f"fails as expected (wrong results, no error): {wrong[0]}", problems
        paths = hit_differences(native["passes"], run["passes"])
        if paths:   # same answers, other cache tiers: the wrong path may never have run
            return "inconclusive: same outputs, different hits", problems + [
                f"the pristine tree's outputs match, but its cache hits do not ({paths[0]}): "
                "this row does not show the failure the series fixes"]
        return "matches native", problems + ["the pristine tree matched native: this row does not show "
                                             "the failure the series fixes"]
    differences = compare(native["passes"], run["passes"], logprob_tol)
    return ("matches native" if not differences else "differs from native"), problems + differences


def weights_problems(run: dict, native: dict | None) -> list[str]:
    """A served dummy-weight run must have drawn trained-scale weights on every rank
    (SGLang's own 1e-3 weights leave the KV cache without effect on any logprob, so a
    match would prove nothing), as many tensors as its native run."""
    counts = run.get("weights_redrawn") or []
    ranks = run.get("tp", 1) * run.get("pp", 1)
    models = run.get("models_per_rank", 1)   # a speculative draft loads its own weights
    if isinstance(counts, bool):
        return ["this report records whether the trained-scale plugin ran, not its tensor count per rank"]
    if len(counts) != ranks * models or not all(counts):
        return [f"dummy weights at SGLang's 1e-3 scale on some rank: the trained-scale plugin drew {counts} "
                f"tensors, one positive count per model and rank expected ({ranks} ranks, {models} "
                f"model{'s' if models > 1 else ''} each)"]
    if native is not None and native is not run and native.get("outcome") == "served" \
            and sorted(native.get("weights_redrawn") or []) != sorted(counts):
        return [f"the trained-scale plugin drew {counts} tensors, native {native.get('weights_redrawn')}"]
    return []


def judge(rows: list[dict], logprob_tol: float) -> list[str]:
    """Fill each row dict's result and problems in place; return all problems, by row."""
    natives = {r["group"]: r for r in rows if r["variant"] == "native"}
    everything = []
    for r in rows:
        native = natives.get(r["group"])
        if r["variant"] == "native":
            if r["expect"] == "refused":
                result, problems = verdict("refused", r, None, logprob_tol, r.get("refusal", ""))
            elif r["outcome"] == "skipped":
                result, problems = f"not run: {r.get('reason', '')}", []
            else:
                problems = native_problems(r, r["l3"]) + shared_problems(r)
                result = "oracle" if not problems else "native failed"
        else:
            result, problems = verdict(r["expect"], r, native, logprob_tol, r.get("refusal", ""))
            shared = shared_problems(r)
            native_failed = native is not None and native["outcome"] == "served" and bool(
                native_problems(native, native["l3"]) + shared_problems(native))
            if native_failed and result in ("matches native", "differs from native"):
                # measured against a native run that did not reach the tier under test
                result = "no verdict: native failed"
            elif shared and result == "matches native":   # a reader that saw nothing shows nothing
                result = "no verdict: " + shared[0]
            problems = problems + shared
        if r.get("dummy") and r["outcome"] == "served":
            problems = problems + weights_problems(r, native)
        r["result"], r["problems"] = result, problems
        everything += [f"{r['key']}: {p}" for p in problems]
    return everything


SUMMARY_KEYS = ("key", "case", "pool", "tp", "pp", "kvcached", "tree", "host_layout", "io_backend", "l3", "l3_store",
                "shared", "result", "start_s", "run_s")


def summary_row(r: dict) -> dict:
    """What a judged row's results table and a committed summary keep of it (results/):
    what ran, the result, pass 2's hit tokens by tier ([device, host, storage], None where
    it did not serve), the start and run seconds."""
    hits = hit_totals(r) if r["outcome"] == "served" else None
    return {**{k: r.get(k) for k in SUMMARY_KEYS},
            "hits": [hits[k] for k in HIT_KINDS] if hits else None}


def markdown_table(rows: list[dict]) -> str:
    """The results table, one line per run: of judged rows or of their summary rows."""
    head = ("| model (config) | pool | TP | kvcached layout | SGLang tree | host layout | L3 | result "
            "| pass-2 hit tokens: device / host / storage | start s | run s |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in (r if "hits" in r else summary_row(r) for r in rows):
        hits = r["hits"]
        lines.append("| " + " | ".join([
            r["case"], r["pool"], str(r["tp"]) + (f" (PP {r['pp']})" if (r.get("pp") or 1) > 1 else ""),
            r["kvcached"] or "off (native)", r["tree"],
            r["host_layout"] + (" (direct io)" if r.get("io_backend") == "direct" else ""),
            ((r.get("l3_store") or "file") + (" (shared: writer, reader)" if r.get("shared") else "")) if r["l3"] else "-",
            r["result"],
            " / ".join(map(str, hits)) if hits else "-",
            f"{r['start_s']:.0f}" if r.get("start_s") is not None else "-",
            f"{r['run_s']:.0f}" if r.get("run_s") is not None else "-",
        ]) + " |")
    return "\n".join(lines)
