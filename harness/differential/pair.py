"""Run the differential cases on a pristine and a patched SGLang tree, side by side, and compare.

    python -m harness.differential.pair --pristine DIR --patched DIR --out OUTDIR \
        [--device cuda --real-kernels] [--case GLOB]

DIR is a folder holding the `sglang/` package (an upstream checkout's python/, or an
installed site folder). Each tree's runner gets PYTHONPATH=DIR:<this repo>:$PYTHONPATH,
so DIR's sglang shadows any other, and a JIT kernel cache of its own (the trees' kernel
sources differ; one cache each also keeps two builds of one kernel from racing).
Writes OUTDIR/pristine.json, patched.json and the runners' logs; each document also
says what the tree holds of the series (`series`: scripts/status's first line, read
before the runners start). Prints the comparison; exits 1 when a case differs. The CPU
tier's test_differential.py calls run_pair.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from harness.differential import compare

ROOT = Path(__file__).resolve().parents[2]


def series_state(tree: Path) -> str:
    """scripts/status's first line for the tree ("SGLang 0.5.20 at ...: series applied";
    it exits 3 for any state but applied)."""
    status = subprocess.run([sys.executable, str(ROOT / "scripts" / "status"), str(tree)],
                            capture_output=True, text=True)
    first = (status.stdout.splitlines() or [""])[0]
    if not first.startswith("SGLang "):
        raise RuntimeError(f"scripts/status {tree} (exit {status.returncode}) did not say what the tree holds: "
                           f"{status.stderr.strip()[-2000:] or status.stdout.strip()[-2000:]}")
    return first


def run_pair(trees: dict[str, Path], out: Path, runner_args: list[str] = ()) -> dict[str, dict]:
    """Run the runner once per tree, at the same time; return their outcome documents."""
    out.mkdir(parents=True, exist_ok=True)
    series = {name: series_state(tree) for name, tree in trees.items()}
    jit_cache = os.environ.get("SGLANG_JIT_CACHE_DIR", str(out / "jit-cache"))
    procs = {}
    for name, tree in trees.items():
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1",
                   # One thread each: the two runners share the machine's cores.
                   OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(tree), str(ROOT), os.environ.get("PYTHONPATH")])),
                   SGLANG_JIT_CACHE_DIR=os.path.join(jit_cache, name))
        log = open(out / f"{name}.log", "w")
        procs[name] = (log, subprocess.Popen(
            [sys.executable, "-m", "harness.differential.runner", "--out", str(out / f"{name}.json"),
             *runner_args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    documents = {}
    for name, (log, proc) in procs.items():
        proc.wait()
        log.close()
        if proc.returncode != 0:
            raise RuntimeError(f"the runner failed on {trees[name]}:\n{(out / f'{name}.log').read_text()[-4000:]}")
        documents[name] = dict(json.loads((out / f"{name}.json").read_text()), series=series[name])
        (out / f"{name}.json").write_text(json.dumps(documents[name]))
    return documents


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pristine", required=True, type=Path, help="folder holding SGLang 0.5.20's sglang/")
    parser.add_argument("--patched", required=True, type=Path, help="folder holding the patched sglang/")
    parser.add_argument("--out", required=True, type=Path)
    args, runner_args = parser.parse_known_args(argv)
    run_pair({"pristine": args.pristine.resolve(), "patched": args.patched.resolve()}, args.out, runner_args)
    compare.main([str(args.out / "pristine.json"), str(args.out / "patched.json")])


if __name__ == "__main__":
    main()
