"""The committed results: one small summary a run, in a fixed schema (results/<name>.json),
from which `make report` renders docs/results.md. Raw reports, logs and profiles stay out
of the tree: a summary says where they are (a commit and paths, or "not kept").

Every summary holds, besides its tool's data:

  schema        SCHEMA
  name          its file's stem: <date>-<what> (e.g. 2026-12-05-h100-bench-server-mla)
  date          YYYY-MM-DD of the run
  tool          one of TOOLS: compare (make e2e), bench-server, transfer (make bench),
                differential (the pristine-vs-patched gate on a GPU), gpu-tier (tests/gpu),
                mutants (make mutants), checkpoint (the converted checkpoint on the CPU),
                sharing (make bench-sharing: several models on one GPU, four variants),
                soak (make soak: models sharing one GPU under faults, answers checked)
  title         one line: what ran
  machine       {"gpu", "gpus" (count), "driver", "cuda"}; "cpu" for a CPU-only run
  versions      {"sglang", "kvcached", "sglang_kernel", "torch", ...} as the run recorded them
  series        {"patches": "0001-0006", "digest": the series digest scripts/apply records}
  server_flags  the launch_server flags every server got, or None
  cuda_graphs   True, False, or None where no server ran
  compiled_ops  "real" (sglang-kernel's compiled ops ran, none on a stand-in), "stand-in",
                or "none" (no compiled op: a CPU run, or SGLang's JIT kernels only)
  command       the command line as the run recorded it
  raw           {"commit", "paths"}: where the raw files are in the history ({} if not kept)
  notes         the run's findings in prose, as its report said them (numbers the docs quote)
  data          the tool's metrics and verdicts: what its table is rendered from

    python -m harness.results check                      (every summary valid; the CPU tier)
    python -m harness.results add TOOL NAME RAW... --title T [--notes FILE] [--set KEY=JSON ...]
                                                         (a new run's summary from its report)

`add` fills machine, versions, series and flags from the report where the tool records them;
--set gives any field (e.g. --set cuda_graphs=true). The history of superseded series,
a few lines a run, is results/history.json: HISTORY_FIELDS each.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import shlex
import sys
from pathlib import Path

from harness.project import ROOT

SCHEMA = 1
RESULTS = ROOT / "results"
HISTORY = RESULTS / "history.json"
TOOLS = ("compare", "bench-server", "transfer", "differential", "gpu-tier", "mutants", "checkpoint", "sharing",
         "soak")
FIELDS = {"schema": int, "name": str, "date": str, "tool": str, "title": str, "machine": dict, "versions": dict,
          "series": dict, "server_flags": (str, type(None)), "cuda_graphs": (bool, type(None)), "compiled_ops": str,
          "command": (str, type(None)), "raw": dict, "notes": str, "data": dict}
COMPILED_OPS = ("real", "stand-in", "none")
HISTORY_FIELDS = {"name": str, "date": str, "tool": str, "series": str, "machine": str, "title": str,
                  "found": str, "raw": dict}


class SummaryError(ValueError):
    """A summary that does not follow the schema: one line naming the file and the field."""


def _check(doc, fields: dict, where: str) -> None:
    if not isinstance(doc, dict):
        raise SummaryError(f"{where}: not a JSON object")
    for key, kind in fields.items():
        if key not in doc:
            raise SummaryError(f"{where}: no {key!r}")
        if not isinstance(doc[key], kind):
            raise SummaryError(f"{where}: {key!r} is {type(doc[key]).__name__}, not {kind}")
    extra = sorted(set(doc) - set(fields))
    if extra:
        raise SummaryError(f"{where}: fields outside the schema: {', '.join(extra)}")


def validate(doc: dict, where: str, stem: str | None = None) -> dict:
    """The summary, or SummaryError saying what in it breaks the schema."""
    _check(doc, FIELDS, where)
    if doc["schema"] != SCHEMA:
        raise SummaryError(f"{where}: schema {doc['schema']}, this harness reads {SCHEMA}")
    if doc["tool"] not in TOOLS:
        raise SummaryError(f"{where}: tool {doc['tool']!r} is none of {', '.join(TOOLS)}")
    if doc["compiled_ops"] not in COMPILED_OPS:
        raise SummaryError(f"{where}: compiled_ops {doc['compiled_ops']!r} is none of {', '.join(COMPILED_OPS)}")
    if stem is not None and doc["name"] != stem:
        raise SummaryError(f"{where}: name {doc['name']!r} is not its file's stem")
    if not doc["name"].startswith(doc["date"] + "-") or len(doc["date"]) != 10:
        raise SummaryError(f"{where}: name {doc['name']!r} does not start with its date {doc['date']!r}")
    return doc


def read(path: Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SummaryError(f"{path}: cannot read it ({exc})") from None
    return validate(doc, str(path), Path(path).stem)


def load_all(folder: Path = RESULTS) -> list[dict]:
    """Every run's summary in `folder`, by name (history.json aside)."""
    return [read(p) for p in sorted(Path(folder).glob("*.json")) if p.name != HISTORY.name]


def load_history(path: Path = HISTORY) -> list[dict]:
    """The superseded runs, newest first."""
    if not Path(path).is_file():
        return []
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SummaryError(f"{path}: cannot read it ({exc})") from None
    if not isinstance(entries, list):
        raise SummaryError(f"{path}: not a list of runs")
    for i, entry in enumerate(entries):
        _check(entry, HISTORY_FIELDS, f"{path} entry {i}")
    return sorted(entries, key=lambda e: e["name"], reverse=True)


def compact(value, digits: int = 10):
    """Floats to `digits` significant digits (a summary keeps what a table shows, and more)."""
    if isinstance(value, float) and math.isfinite(value) and value:
        return round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))
    if isinstance(value, dict):
        return {k: compact(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [compact(v, digits) for v in value]
    return value


def raw_json(path: Path):
    """A tool's JSON output, gzipped or not; a JSONL journal as a list of its whole lines."""
    data = Path(path).read_bytes()
    text = (gzip.decompress(data) if Path(path).suffix == ".gz" else data).decode()
    if Path(path).name.removesuffix(".gz").endswith(".jsonl"):
        lines = []
        for line in filter(str.strip, text.splitlines()):
            try:
                lines.append(json.loads(line))
            except ValueError:     # a run killed while writing its last line
                break
        return lines
    return json.loads(text)


# ---- each tool's data, from its raw output -------------------------------------------------

def compare_data(paths: list[Path]) -> dict:
    """The server comparison: each report's rows judged again, as its table shows them."""
    from harness.compare import runner, verdict
    tables = []
    for path in paths:
        rows = runner.read_rows(Path(path), 0.0)
        tables.append({"label": Path(path).name.split(".")[0], "rows": [verdict.summary_row(r) for r in rows],
                       "problems": [f"{r['key']}: {p}" for r in rows for p in r["problems"]]})
    return {"tables": tables}


def bench_server_data(paths: list[Path]) -> dict:
    from harness import bench_server
    return {"reports": [{"label": Path(p).name.split(".")[0], **bench_server.summary(raw_json(p))} for p in paths]}


def sharing_data(paths: list[Path]) -> dict:
    """Each sharing run (its report.json, or its journal.jsonl: the report made again)."""
    from harness.sharing import summary
    return {"reports": [{"label": Path(p).name.split(".")[0], **summary.summary(summary.load(p))} for p in paths]}


SOAK_KEYS = ("result", "problems", "duration_s", "requests", "aborted_on_purpose", "errors", "errors_other_roles",
             "lost_to_faults", "host_hit_tokens", "mismatches", "crashes", "reclaims", "reclaimed_bytes",
             "reclaim_pairs", "faults", "ballast_exited", "latency", "budget", "harness_failures", "sgl_kernel_ops")


def soak_report(path: Path) -> dict:
    """A soak's report (harness.soak's --out), or its journal (<out>.events.jsonl[.gz]): the
    report made again. A report written before reports kept their environment is made
    again from the journal beside it."""
    r = raw_json(path)
    if isinstance(r, dict) and "environment" not in r:
        beside = [Path(path).with_suffix(suffix) for suffix in (".events.jsonl", ".events.jsonl.gz")]
        journal = next((p for p in beside if p.is_file()), None)
        if journal is None:
            raise SummaryError(f"{path}: a soak report without its environment (GPU, versions): "
                               f"give its journal, {beside[0].name}")
        r = raw_json(journal)
    if isinstance(r, list):
        from harness.soak import verdict
        r = verdict.summarize(r)
    return r


def soak_data(paths: list[Path]) -> dict:
    """Each soak's report, without what only a rerun needs: the servers' command lines, the
    oracle's per-answer details, the raw counters."""
    reports = []
    for path in paths:
        r = soak_report(path)
        oracle = {k: v for k, v in (r.get("oracle") or {}).items() if k != "details"}
        servers = [{k: v for k, v in s.items() if k not in ("command", "log")} for s in r.get("servers") or []]
        config = {k: v for k, v in (r.get("config") or {}).items() if k != "argv"}
        reports.append({"label": Path(path).name.split(".")[0], **{k: r.get(k) for k in SOAK_KEYS},
                        "oracle": oracle, "servers": servers, "config": config})
    return {"reports": reports}


def transfer_data(paths: list[Path]) -> dict:
    """Saved transfer runs pooled (transfer_bench --table's rows), with the first run's setup."""
    from harness import transfer_bench
    return {"meta": raw_json(paths[0])["meta"],
            **transfer_bench.summary(transfer_bench.saved_rows([str(p) for p in paths]))}


PAIR_COUNTS = re.compile(r"^(pristine|patched): (.*) \((.*)\): (\d+) cases, (\d+) steps, (\d+) not run$")


def differential_data(paths: list[Path]) -> dict:
    """The differential pair's printout (harness.differential.pair): each tree's counts,
    the state entries only the patched tree has, and whether every case was identical."""
    text = Path(paths[0]).read_text()
    trees, only_patched = {}, []
    for line in text.splitlines():
        if m := PAIR_COUNTS.match(line):
            trees[m[1]] = {"tree": m[2], "kernels": m[3], "cases": int(m[4]), "steps": int(m[5]),
                           "not_run": int(m[6])}
        elif line.startswith("state entries only the patched tree has: "):
            only_patched = json.loads(line.split(": ", 1)[1].replace("'", '"'))
    if set(trees) != {"pristine", "patched"}:
        raise SummaryError(f"{paths[0]}: not the pair's printout (no pristine and patched counts)")
    return {"trees": trees, "only_patched_state": only_patched,
            "identical": any(line.strip() == "identical" for line in text.splitlines())}


GPU_TIER_KEYS = ("test", "kvcached_layout", "host_layout", "io_backend", "trips", "result", "seconds", "time",
                 "sgl_kernel")


def gpu_tier_data(paths: list[Path], series: str | None = None) -> dict:
    """The GPU tier's rows (tests/gpu/run_tier.sh's results.jsonl) of the series whose label
    starts with `series` (default: the newest row's label)."""
    rows = [r for p in paths for r in raw_json(p)]
    series = series or max(rows, key=lambda r: r["time"])["series"]
    mine = [r for r in rows if r["series"].startswith(series)]
    if not mine:
        raise SummaryError(f"no GPU tier row of a series labelled {series!r}")
    return {"series": sorted({r["series"] for r in mine}), "gpu": mine[0].get("gpu"),
            "rows": [{k: r.get(k) for k in GPU_TIER_KEYS} for r in sorted(mine, key=lambda r: r["time"])]}


def mutants_data(paths: list[Path]) -> dict:
    """Each mutation report (harness.mutants): its counts, and every mutant not killed."""
    runs = []
    for path in paths:
        r = raw_json(path)
        runs.append({"label": Path(path).name.split(".")[0], "series": r["series"],
                     "added_code_lines": r["added_code_lines"], "seconds": r["seconds"], "jobs": r["jobs"],
                     "limit": r["limit"], "summary": r["summary"], "failing_unmutated": r["failing_unmutated"],
                     "not_killed": [{k: m[k] for k in ("file", "line", "operator", "diff", "status")}
                                    for m in r["mutants"] if m["status"] != "killed"]})
    return {"runs": runs}


def environment_fields(report: dict) -> dict:
    """machine, versions, server_flags and compiled_ops from a comparison's or a server
    benchmark's report (`environment`, `config`, `sgl_kernel_ops`)."""
    env = report.get("environment") or {}
    gpus = env.get("gpus") or []
    name, driver, _ = (gpus[0].split(", ") + ["", "", ""])[:3] if gpus else ("", "", "")
    versions = env.get("versions") if isinstance(env.get("versions"), dict) else {}
    kernel = versions.get("sgl_kernel") or ""
    flags = env.get("server_flags") or (report.get("config") or {}).get("server_flags")
    ops = report.get("sgl_kernel_ops")
    return {"machine": {"gpu": name, "gpus": len(gpus), "driver": driver, "cuda": versions.get("cuda")},
            "versions": {"sglang": versions.get("sglang"), "kvcached": versions.get("kvcached"),
                         "sglang_kernel": kernel.split(" (")[0] or None, "torch": versions.get("torch")},
            "server_flags": " ".join(flags) if isinstance(flags, list) else flags,
            "compiled_ops": "stand-in" if "stand-in" in kernel or (ops and ops.get("ops_on_stand_in"))
            else "real" if "real ops" in kernel else "none"}


def series_of(patches) -> dict:
    """{"patches": "0001-0006", "digest": its first 16 hex digits} of a report's `patches` (a
    digest, or {"digest", "files"}); the range from the files, else from patches/ where the
    digest is the series' as it stands, else "unknown"."""
    digest = (patches.get("digest") if isinstance(patches, dict) else patches) or ""
    names = [n for n in (patches.get("files") or {}) if n != "series"] if isinstance(patches, dict) else []
    if not names:
        from harness.project import patches_state
        current = patches_state()
        names = [n for n in current["files"] if n != "series"] if current["digest"] == digest else []
    span = f"{names[0][:4]}-{names[-1][:4]}" if names else "unknown"
    return {"patches": span, "digest": digest[:16]}


def make(tool: str, name: str, raw_paths: list[Path], title: str, notes: str = "", **fields) -> dict:
    """A summary of a run's raw output; `fields` override what the report records."""
    data = {"compare": compare_data, "bench-server": bench_server_data, "transfer": transfer_data,
            "differential": differential_data, "gpu-tier": gpu_tier_data, "mutants": mutants_data,
            "sharing": sharing_data, "soak": soak_data}[tool](raw_paths)
    first = raw_json(raw_paths[0]) if tool in ("compare", "bench-server") else {}
    if tool == "sharing":
        from harness.sharing import summary
        first = summary.load(raw_paths[0])
    if tool == "soak":
        report = soak_report(raw_paths[0])
        config = report.get("config") or {}
        first = {**report, "argv": config.get("argv"), "patches": config.get("patches"),
                 "config": {"server_flags": " ".join(config.get("server_flags") or []) or None}}
    first = first if isinstance(first, dict) else {}
    doc = {"schema": SCHEMA, "name": name, "date": name[:10], "tool": tool, "title": title,
           **environment_fields(first), "series": series_of(first.get("patches")),
           "cuda_graphs": None, "command": shlex.join(first.get("argv") or []) or None,
           "raw": {}, "notes": notes, "data": compact(data)}
    if doc["server_flags"] is not None:        # SGLang captures CUDA graphs unless told not to
        doc["cuda_graphs"] = "--disable-cuda-graph" not in doc["server_flags"].split()
    doc.update(fields)
    return validate(doc, name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    sub.add_parser("check", help="every summary in results/ follows the schema")
    add = sub.add_parser("add", help="write results/NAME.json from a run's raw output")
    add.add_argument("tool", choices=[t for t in TOOLS if t != "checkpoint"])
    add.add_argument("name", help="<date>-<what>, the summary's file stem")
    add.add_argument("raw", nargs="+", type=Path, help="the run's report(s) or output file(s)")
    add.add_argument("--title", required=True)
    add.add_argument("--notes", type=Path, help="a file holding the run's findings")
    add.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="a field, e.g. cuda_graphs=true")
    add.add_argument("--out", type=Path, default=RESULTS)
    opts = ap.parse_args(argv)
    try:
        if opts.verb == "check":
            print(f"{len(load_all())} summaries and {len(load_history())} superseded runs follow schema {SCHEMA}")
            return 0
        fields = {}
        for pair in opts.set:
            key, sep, value = pair.partition("=")
            if not sep or key not in FIELDS:
                raise SummaryError(f"--set {pair!r}: KEY=JSON with KEY one of {', '.join(FIELDS)}")
            fields[key] = json.loads(value)
        notes = opts.notes.read_text() if opts.notes else ""
        doc = make(opts.tool, opts.name, opts.raw, opts.title, notes, **fields)
    except (SummaryError, OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / f"{opts.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {opts.out / opts.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
