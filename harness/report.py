"""docs/results.md from the committed summaries (`make report`): every current run's table,
rendered by the tool that made the run, newest first within each tool, then the history of
the runs of superseded series, a few lines each. Plots are rendered, never committed: into
--plots (default build/report/) where matplotlib is installed.

    python -m harness.report [--out docs/results.md] [--plots build/report] [--check]

--check writes nothing and exits 1 when --out differs from what the summaries render (the
CPU tier runs it: the file is regenerated, never edited). A summary that breaks the schema
stops it in one line: `error: results/<name>.json: ...`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import results
from harness.project import ROOT, make_out

SECTIONS = (
    ("compare", "Server comparison: native vs kvcached, every pool kind (`make e2e`)"),
    ("bench-server", "Server benchmark: SGLang's bench_serving, kvcached vs native (`make bench-server`)"),
    ("sharing", "Several models sharing one GPU: static splits vs kvcached, HiCache off and on (`make bench-sharing`)"),
    ("soak", "Models sharing one GPU under faults, answers checked (`make soak`)"),
    ("transfer", "HiCache transfers (`make bench`)"),
    ("differential", "Differential gate on a GPU: pristine vs patched, SGLang's dense pools"),
    ("gpu-tier", "GPU tier (`make test-gpu`)"),
    ("mutants", "Mutation audit (`make mutants`)"),
    ("checkpoint", "The trained checkpoint on the CPU (`make test-checkpoint`)"),
)


SHOWN = 5   # a comparison's problems listed; every one is in its summary


def demoted(markdown: str) -> str:
    """A tool's markdown under a run's heading: its title dropped, its sections two levels down."""
    lines = [line for line in markdown.splitlines() if not line.startswith("# ")]
    return "\n".join("##" + line if line.startswith("#") else line for line in lines).strip()


def setting(doc: dict) -> str:
    """One line: the machine, the versions, the series and how the servers ran."""
    m, v, s = doc["machine"], doc["versions"], doc["series"]
    where = (f"{m.get('gpus', 1)} x {m['gpu']}" if m.get("gpus", 1) > 1 else m["gpu"]) if m.get("gpu") \
        else f"CPU ({m.get('cpu', '?')})"
    parts = [where + (f", driver {m['driver']}" if m.get("driver") else "") + (f", CUDA {m['cuda']}" if m.get("cuda") else "")]
    parts.append(", ".join(f"{k.replace('_', '-')} {x}" for k, x in v.items() if x and not isinstance(x, dict)))
    parts.append(f"series {s['patches']}" + (f" (digest {s['digest']})" if s.get("digest") else ""))
    parts.append(f"sglang-kernel's compiled ops: {doc['compiled_ops']}")
    if doc["cuda_graphs"] is not None:
        parts.append(f"CUDA graphs {'on' if doc['cuda_graphs'] else 'off'}")
    if doc["server_flags"]:
        parts.append(f"server flags `{doc['server_flags']}`")
    return "; ".join(parts) + "."


def compare(data: dict) -> str:
    from harness.compare import verdict
    out = []
    for table in data["tables"]:
        if len(data["tables"]) > 1:
            out.append(f"#### {table['label']}\n")
        out.append(verdict.markdown_table(table["rows"]))
        problems = table["problems"]
        if problems:
            more = f"\n- ... {len(problems) - SHOWN} more in the summary" if len(problems) > SHOWN else ""
            out.append("\nProblems:\n\n" + "\n".join(f"- {p}" for p in problems[:SHOWN]) + more)
        out.append("")
    return "\n".join(out).strip()


def bench_server(data: dict) -> str:
    from harness import bench_server as tool
    if not data["reports"]:
        return "No report was kept (the run stopped before writing it): its numbers are in the summary's notes."
    return "\n\n".join((f"#### {r['label']}\n\n" if len(data["reports"]) > 1 else "") + demoted(tool.render(r))
                       for r in data["reports"])


def sharing(data: dict) -> str:
    from harness.sharing import summary
    return "\n\n".join((f"#### {r['label']}\n\n" if len(data["reports"]) > 1 else "") + demoted(summary.render(r))
                       for r in data["reports"])


def soak(data: dict) -> str:
    from harness.soak import verdict
    out = [verdict.table({r["label"]: r for r in data["reports"]})]
    for r in data["reports"]:
        label = f"{r['label']}: " if len(data["reports"]) > 1 else ""
        out += [f"\n{label}" + ("Problems:\n\n" + "\n".join(f"- {p}" for p in r["problems"])
                                if r["problems"] else "No problem found.")]
    return "\n".join(out).strip()


def transfer(data: dict) -> str:
    from harness import transfer_bench
    return transfer_bench.table(transfer_bench.summary_rows(data))


def differential(data: dict) -> str:
    lines = ["| tree | kernels | cases | steps | not run |", "|---|---|---:|---:|---:|"]
    lines += [f"| {name} | {t['kernels']} | {t['cases']} | {t['steps']} | {t['not_run']} |"
              for name, t in data["trees"].items()]
    lines += ["", "Every case identical." if data["identical"] else "Some case differs (see the notes).",
              "State only the patched tree records: " + (", ".join(f"`{e}`" for e in data["only_patched_state"])
                                                         or "none") + "."]
    return "\n".join(lines)


def gpu_tier(data: dict) -> str:
    cells: dict[tuple, set] = {}
    for r in data["rows"]:
        key = (r["test"], r.get("kvcached_layout") or "-", r.get("host_layout") or "-", r.get("io_backend") or "-")
        cells.setdefault(key, set()).add(r["result"])
    rows = data["rows"]
    lines = [f"Series: {'; '.join(data['series'])}; {rows[0]['time']} to {rows[-1]['time']}. Only a test that "
             "passes writes a row: what failed on the way is in the notes.", "",
             "| test | kvcached layout | host layout | io | result |", "|---|---|---|---|---|"]
    lines += [f"| {t} | {k} | {h} | {i} | {', '.join(sorted(v))} |" for (t, k, h, i), v in sorted(cells.items())]
    return "\n".join(lines)


def mutants(data: dict) -> str:
    lines = ["| run | series lines | mutants | killed | survived | timed out | errors | equivalent, skipped | minutes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in data["runs"]:
        s = r["summary"]
        lines.append(f"| {r['label']} | {r['added_code_lines']} | {s['total']} | {s['killed']} | {s['survived']} | "
                     f"{s['timeout']} | {s['error']} | {s['equivalent_skipped']} | {r['seconds'] / 60:.0f} |")
    survivors = [f"- {r['label']}: {m['file']}:{m['line']} [{m['operator']}] {m['status']}"
                 for r in data["runs"] for m in r["not_killed"]]
    return "\n".join(lines + ([""] + survivors if survivors else []))


def checkpoint(data: dict) -> str:
    src = data["source"]
    lines = [f"`{src['source']}` ({src['gguf']}, {src['parameters']:,} parameters); greedy, "
             f"{data['max_new_tokens']} new tokens; fp32: {data['variants']['fp32']}; bf16: {data['variants']['bf16']}.",
             "", "| request | prompt tokens | fp32 answer | bf16 answer | same ids |", "|---|---:|---|---|---|"]
    lines += [f"| {r['id']} | {r['prompt_tokens']} | {r['fp32']} | {r['bf16']} | {'yes' if r['same_ids'] else 'no'} |"
              for r in data["requests"]]
    return "\n".join(lines)


RENDER = {"compare": compare, "bench-server": bench_server, "transfer": transfer, "differential": differential,
          "gpu-tier": gpu_tier, "mutants": mutants, "checkpoint": checkpoint, "sharing": sharing,
          "soak": soak}


def history(entries: list[dict]) -> list[str]:
    lines = ["## History: runs of superseded series", "",
             "Runs of the series before its rework into the six patches of `patches/`, a few lines each "
             "(`results/history.json`); each names the commit whose tree holds its files.", ""]
    for e in entries:
        raw = e["raw"]
        where = f"`{raw['commit']}`" + (f" (reports and logs: `{raw['earlier']['commit']}`)" if raw.get("earlier") else "")
        lines.append(f"- **{e['name']}** ({e['tool']}; {e['series']}; {e['machine']}): {e['title']}. {e['found'][:1].upper() + e['found'][1:]} "
                     f"Files at {where}.")
    return lines + [""]


def render(docs: list[dict], entries: list[dict]) -> str:
    out = ["# Results, rendered from the committed summaries", "",
           "Generated by `make report` (`python -m harness.report`) from `results/*.json` (one summary a run, "
           "schema in `harness/results.py`); do not edit. Each summary also holds the run's command, its findings "
           "in prose (`notes`) and where its raw files are.", ""]
    for tool, heading in SECTIONS:
        mine = sorted((d for d in docs if d["tool"] == tool), key=lambda d: d["name"], reverse=True)
        if not mine:
            continue
        out += [f"## {heading}", ""]
        for doc in mine:
            out += [f"### {doc['name']}: {doc['title']}", "", f"`results/{doc['name']}.json`. {setting(doc)}", "",
                    RENDER[tool](doc["data"]), ""]
    out += history(entries)
    return "\n".join(out).rstrip() + "\n"


def plots(docs: list[dict], folder: Path) -> list[Path]:
    """Each run's figure (bench-server: ratios; transfer: GB/s by batch; sharing: TTFT over
    each phase) into folder; [] without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return []
    from harness import bench_server, plot, transfer_bench
    from harness.sharing import summary as sharing_summary
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for doc in docs:
        if doc["tool"] == "bench-server":
            for r in doc["data"]["reports"]:
                path = folder / f"{doc['name']}{'-' + r['label'] if len(doc['data']['reports']) > 1 else ''}.png"
                if bench_server.plot(r, path):
                    made.append(path)
        elif doc["tool"] == "sharing":
            for r in doc["data"]["reports"]:
                path = folder / f"{doc['name']}{'-' + r['label'] if len(doc['data']['reports']) > 1 else ''}-ttft.png"
                if sharing_summary.plot(r, path):
                    made.append(path)
        elif doc["tool"] == "transfer":
            rows = [r for r in transfer_bench.summary_rows(doc["data"]) if "GBps" in r]
            path = folder / f"{doc['name']}.png"
            plot.draw(rows, doc["data"].get("meta", {}), path)
            made.append(path)
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    ap.add_argument("--plots", default=str(ROOT / "build" / "report"), help="where the figures go")
    ap.add_argument("--results", default=str(results.RESULTS), help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true", help="exit 1 where --out is not what the summaries render")
    opts = ap.parse_args(argv)
    if not opts.check and (why := make_out(opts.out)):
        ap.error(why)
    try:
        docs = results.load_all(Path(opts.results))
        text = render(docs, results.load_history(Path(opts.results) / results.HISTORY.name))
    except results.SummaryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(opts.out)
    if opts.check:
        if not out.is_file() or out.read_bytes() != text.encode():   # bytes: --out may be any file
            print(f"{out} is not what results/ renders: run `make report`", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    made = plots(docs, Path(opts.plots))
    print(f"wrote {out}" + (f" and {len(made)} plots in {opts.plots}" if made else
                            " (no plots: matplotlib is not installed, requirements/bench.txt)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
