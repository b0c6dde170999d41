"""Compare two runners' outcomes (runner.py), pristine tree against patched, case by case.

Everything must be equal: the cases and their steps, each step's result or exception
(type and message), sizes, the layout of every tensor, the bytes of every storage after
every step. A step whose emulated kernel would fault on a GPU (a copy outside its
allocation, a null pointer, a division by zero in the launcher) fails its case on either
tree. One allowance: inside a recorded state (scalars, tensors, hashes, pointer
tables), the patched tree may have entries the pristine one lacks (an attribute or
table the series adds); they are listed, not failed. What pristine has must be there
and equal. The `debug` part (tracebacks, timings) is never compared; it is shown next
to a difference.
"""
from __future__ import annotations

import json

STATE_PARTS = {"scalars", "tensors", "hashes", "pointers"}
NOT_COMPARED = {"debug"}
_MISSING = object()


class Differences:
    def __init__(self):
        self.first: list[str] = []       # one line per differing case: its first difference
        self.added: set[str] = set()     # state entries only the patched tree has


def _describe(value) -> str:
    if value is _MISSING:
        return "(absent)"
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 300 else text[:300] + "..."


def _diff(expected, actual, path, differences, in_state_part=False):
    """The first difference under `path`, or None; records additions."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        if "step" in expected and "error" in actual and "error" not in expected:
            return f"{path}: pristine runs it, patched raises {_describe(actual['error'])}"
        for key in expected:
            if key in NOT_COMPARED:
                continue
            found = _diff(expected[key], actual.get(key, _MISSING), f"{path}.{key}", differences,
                          in_state_part or key in STATE_PARTS)
            if found:
                return found
        extra = [key for key in actual if key not in expected and key not in NOT_COMPARED]
        if extra and in_state_part:
            where = path.split(".state.", 1)[-1]  # e.g. scalars.kv.host
            differences.added.update(f"{where}.{key}" for key in extra)
        elif extra:
            return f"{path}.{extra[0]}: pristine has no such entry, patched has {_describe(actual[extra[0]])}"
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        for i, (e, a) in enumerate(zip(expected, actual)):
            label = e.get("step") if isinstance(e, dict) and "step" in e else None
            found = _diff(e, a, f"{path}[{i}]" + (f"({label})" if label else ""), differences, in_state_part)
            if found:
                return found
        if len(expected) != len(actual):
            i = min(len(expected), len(actual))
            return (f"{path}[{i}]: pristine has {_describe(expected[i] if i < len(expected) else _MISSING)}, "
                    f"patched has {_describe(actual[i] if i < len(actual) else _MISSING)}")
        return None
    if expected != actual:
        return f"{path}: pristine {_describe(expected)}, patched {_describe(actual)}"
    return None


def _debug(case, difference):
    """The tracebacks of the step a difference is in, if it raised."""
    step = difference.split("(", 1)[1].split(")", 1)[0] if "(" in difference else None
    return case.get("debug", {}).get(step, "") if step else ""


# The emulators' messages for what a GPU does not refuse but suffers: a copy outside its
# allocation (harness.emulation.memory.Region.at), a null pointer in a kernel's pointer table
# (Region.of_address), the launcher's integer division by zero (harness.emulation.aot._indices).
FAULTS = ("illegal memory access", "null pointer in a kernel pointer table", "integer division by zero")


def _fault(case: dict | None, tree: str) -> str | None:
    """The first step whose kernel would fault on a GPU. Never a match, even when both trees
    do it: there such a copy corrupts memory or kills the process, so the case proves
    nothing (a geometry the case got wrong, or a bug)."""
    for step in (case or {}).get("steps", []):
        message = step.get("error", {}).get("message", "")
        if any(fault in message for fault in FAULTS):
            return f"{case['id']}({step['step']}): {tree} would fault on a GPU: {message}"
    return None


def compare(pristine: dict, patched: dict) -> Differences:
    differences = Differences()
    cases_p = {case["id"]: case for case in pristine["cases"]}
    cases_q = {case["id"]: case for case in patched["cases"]}
    if list(cases_p) != list(cases_q):
        missing = [c for c in cases_p if c not in cases_q]
        extra = [c for c in cases_q if c not in cases_p]
        differences.first.append(f"the case lists differ: only pristine {missing[:5]}, only patched {extra[:5]}")
    for case_id, expected in cases_p.items():
        actual = cases_q.get(case_id)
        if actual is None:
            continue
        found = _fault(expected, "pristine") or _fault(actual, "patched") or \
            _diff(expected, actual, case_id, differences)
        if found:
            tb_p, tb_q = _debug(expected, found), _debug(actual, found)
            detail = "".join(f"\n    {side} raised at:\n      " + tb.strip().replace("\n", "\n      ")
                             for side, tb in (("pristine", tb_p), ("patched", tb_q)) if tb)
            differences.first.append(found + detail)
    return differences


def report(differences: Differences, limit: int = 12) -> str:
    lines = [f"{len(differences.first)} case(s) differ between pristine SGLang and the patched tree; "
             "the first difference of each:"]
    lines += [f"  - {line}" for line in differences.first[:limit]]
    if len(differences.first) > limit:
        lines.append(f"  ... and {len(differences.first) - limit} more")
    return "\n".join(lines)


def main(argv=None):
    """python -m harness.differential.compare PRISTINE.json PATCHED.json"""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description="Compare two runner outcome files, pristine first.")
    parser.add_argument("pristine")
    parser.add_argument("patched")
    args = parser.parse_args(argv)
    with open(args.pristine) as a, open(args.patched) as b:
        pristine, patched = json.load(a), json.load(b)
    differences = compare(pristine, patched)
    if pristine.get("choices") != patched.get("choices"):
        differences.first.insert(0, "the trees' parsers accept different layouts or io backends")
    for name, doc in (("pristine", pristine), ("patched", patched)):
        print(f"{name}: {doc['sglang']} ({doc['device']}, kernels {doc['kernels']}): {len(doc['cases'])} cases, "
              f"{doc['steps']} steps, {doc['steps_not_run']} not run")
    if differences.added:
        print(f"state entries only the patched tree has: {sorted(differences.added)}")
    if differences.first:
        print(report(differences, limit=len(differences.first)))
        sys.exit(1)
    print("identical")


if __name__ == "__main__":
    main()
