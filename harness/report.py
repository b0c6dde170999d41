#!/usr/bin/env python3
"""docs/results.md from the committed runs (`make report`): each tier's newest run rendered
by the tool that made it, the older runs listed by name with their READMEs' first lines.

    python3 ci/report.py [--out docs/results.md] [--check]

A tier's runs are the folders under its place (docs/runs/<tier>/, bench/results/) named
<date>-<what>; the newest date's folders are rendered (server benchmarks: per shape, the newest
run of each set of variants that no newer run covers), each through its own renderer
(harness.compare --table, bench_server.py --render, transfer_bench.py --table,
tests.support.differential.compare, the GPU tier's rows of its newest series). --check
exits 1 when the file differs from what the runs render (it is regenerated, never edited).
A run folder it cannot read stops it in one line: `error: <folder>: ...`.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "runs"
BENCH = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))
from tests.e2e.servers import make_out  # noqa: E402  (the tools' one --out check)


def tool(*argv: str) -> str:
    """What one of the project's renderers prints for a committed run."""
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise SystemExit(f"error: {' '.join(argv)} failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    return proc.stdout.strip()


def folders(place: Path, keep=lambda path: True) -> list[Path]:
    return sorted((p for p in place.iterdir() if p.is_dir() and p.name[:4].isdigit() and keep(p)),
                  key=lambda p: p.name, reverse=True) if place.is_dir() else []


def newest(runs: list[Path]) -> tuple[list[Path], list[Path]]:
    """The folders of the newest date, then the rest."""
    if not runs:
        return [], []
    day = runs[0].name[:10]
    return [p for p in runs if p.name.startswith(day)], [p for p in runs if not p.name.startswith(day)]


@contextlib.contextmanager
def reading(folder: Path):
    """A run folder whose files cannot be read as its tool wrote them: one line naming it."""
    try:
        yield
    except (OSError, ValueError, LookupError, TypeError, AttributeError) as exc:
        raise SystemExit(f"error: {folder.relative_to(ROOT)}: {type(exc).__name__}: {exc}") from None


def title(folder: Path) -> str:
    """A run's README's first line (its heading), else the folder's name."""
    readme = folder / "README.md"
    if not readme.is_file():
        return folder.name
    with reading(folder):
        heading = readme.read_text().partition("\n")[0].lstrip("# ").strip()
        if not heading:
            raise ValueError("README.md has no title line (its first line)")
    return heading


def transfer_runs(folder: Path) -> list[Path]:
    """A transfer benchmark run's JSON files (one per invocation, pooled by --table); a
    server benchmark's folder holds report.json instead."""
    return [] if (folder / "report.json").is_file() else sorted(folder.glob("*.json"))


def listed(folder: Path) -> str:
    return f"- `{folder.relative_to(ROOT)}`: {title(folder)}"


def demoted(markdown: str) -> str:
    """A renderer's markdown under this file's headings: its title dropped, its sections
    two levels down."""
    lines = [line for line in markdown.splitlines() if not line.startswith("# ")]
    return "\n".join("##" + line if line.startswith("#") else line for line in lines).strip()


def newest_of_each_shape(runs: list[Path]) -> tuple[list[Path], list[Path]]:
    """Server benchmark runs, newest (by its start) first: a run is shown where, for some shape and
    workload, it measured variants that no newer shown run of that shape and workload measured all
    of; then the rest. A run of one shape, one workload (multi-turn), or other variants (the
    no-HiCache pair) hides no other."""
    started, measured = {}, {}
    for run in runs:
        with reading(run):
            report = json.loads((run / "report.json").read_text())
            started[run] = report["started"]
            measured[run] = {(name, workload): {r["variant"] for r in clients["runs"] if r.get("metrics")}
                             for name, shape in report["shapes"].items()
                             for workload, clients in shape["workloads"].items()}
    shown, seen = [], collections.defaultdict(list)
    for run in sorted(runs, key=lambda r: started[r], reverse=True):
        new = {key: variants for key, variants in measured[run].items()
               if variants and not any(variants <= earlier for earlier in seen[key])}
        if new:
            shown.append(run)
            for key, variants in new.items():
                seen[key].append(variants)
    return shown, [r for r in runs if r not in shown]


def section(name: str, runs: list[Path], render, renders=lambda folder: True, pick=newest) -> list[str]:
    """The runs that ``renders`` accepts and ``pick`` shows (default: the newest date's), rendered;
    every other run listed."""
    shown, _ = pick([p for p in runs if renders(p)])
    lines = [f"## {name}", ""]
    if not shown:
        lines += ["No committed run.", ""]
    for folder in shown:
        with reading(folder):
            lines += [f"### `{folder.relative_to(ROOT)}`", "", title(folder), "", render(folder), ""]
    others = [p for p in runs if p not in shown]
    if others:
        lines += ["Other runs (their READMEs say what each ran and found):", "", *map(listed, others), ""]
    return lines


def e2e_reports(folder: Path) -> list[Path]:
    """A run's reports, else its journal (a run stopped before it wrote its report)."""
    return sorted(folder.glob("*report.json*")) or sorted(folder.glob("*report.rows.jsonl*"))


def e2e(folder: Path) -> str:
    reports = e2e_reports(folder)
    return "\n\n".join(tool("tests/e2e/harness.compare", "--table", str(r)) for r in reports)


def differential_rendered(folder: Path) -> bool:
    return (folder / "patched.json.gz").is_file() or (folder / "differential.log").is_file()


def differential(folder: Path) -> str:
    """The outcome documents' table; for a run that kept only the pair's printout, that."""
    if not (folder / "patched.json.gz").is_file():
        printed = (folder / "differential.log").read_text().strip()
        return f"The pair's summary (`differential.log`; the outcome documents were not kept):\n\n```\n{printed}\n```"
    from tests.support.differential.compare import summary_table
    docs = [json.loads(gzip.decompress((folder / f"{n}.json.gz").read_bytes())) for n in ("pristine", "patched")]
    return summary_table(*docs)


def gpu_tier(rows_file: Path) -> str:
    """The rows of the newest series the file holds: test x configuration -> result."""
    rows = [json.loads(line) for line in rows_file.read_text().splitlines() if line.strip()]
    series = max(rows, key=lambda r: r["time"])["series"]
    mine = [r for r in rows if r["series"] == series]
    results = collections.defaultdict(list)
    for r in mine:
        key = (r["test"], r.get("kvcached_layout", "-"), r.get("host_layout", "-"), r.get("io_backend", "-"))
        results[key].append(r["result"])
    kernels = sorted({r.get("sgl_kernel", "import stand-in") for r in mine})
    lines = [f"Series `{series}`, {min(r['time'] for r in mine)} to {max(r['time'] for r in mine)}, "
             f"{mine[0].get('gpu', '?')}, sgl_kernel: {', '.join(kernels)}.", "",
             "| test | kvcached layout | host layout | io | result |", "|---|---|---|---|---|"]
    lines += [f"| {t} | {k} | {h} | {i} | {', '.join(sorted(set(v)))} |" for (t, k, h, i), v in sorted(results.items())]
    lines += ["", "Only a test that passes writes a row: a run's failures are in its summary (the `.txt` files "
              f"beside `{rows_file.relative_to(ROOT)}`) and `docs/gpu-results.md`."]
    return "\n".join(lines)


def render() -> str:
    out = ["# Results, rendered from the committed runs",
           "",
           "Generated by `make report` (`ci/report.py`) from the run folders named below; do not",
           "edit. Each run's README says the command, the machine, the versions and the series.",
           ""]
    out += section("Server matrix: native vs kvcached (`tests/e2e/harness.compare`)",
                   folders(RUNS / "e2e"), e2e, e2e_reports)
    out += section("Server benchmark: SGLang's bench_serving (`make bench-server`)",
                   folders(BENCH, lambda p: (p / "report.json").is_file()),
                   lambda f: demoted(tool("harness/bench_server.py", "--render", str(f / "report.json"))),
                   pick=newest_of_each_shape)
    out += section("Differential gate on a GPU (pristine vs patched, dense pools)",
                   folders(RUNS / "differential"), differential, differential_rendered)
    out += ["## GPU tier (`tests/gpu`, `docs/runs/gpu-tier/results.jsonl`)", "",
            gpu_tier(RUNS / "gpu-tier" / "results.jsonl"), ""]
    out += section("Transfers (`make bench`, `harness/transfer_bench.py --table`)",
                   folders(BENCH, lambda p: bool(transfer_runs(p))),
                   lambda f: tool("harness/transfer_bench.py", "--table", *map(str, transfer_runs(f))))
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "results.md"))
    ap.add_argument("--check", action="store_true", help="exit 1 where --out is not what the runs render")
    opts = ap.parse_args(argv)
    if not opts.check and (why := make_out(opts.out)):
        ap.error(why)
    text, out = render(), Path(opts.out)
    if opts.check:
        if not out.is_file() or out.read_bytes() != text.encode():   # bytes: --out may be any file
            print(f"{out} is not what the committed runs render: run `make report`", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
