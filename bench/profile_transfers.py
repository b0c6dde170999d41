"""Where a HiCache transfer's time goes: the host issuing it, or the GPU kernels.

    python bench/profile_transfers.py --native-sglang <pristine python/> --out profile.json

transfer_bench.py times each operation with CUDA events; at small batches that time can
be the host's (Python and kernel launches) or the GPU's, and the two need different
fixes. For the same pools, index sets and variants (one child process each) this
measures, per case (pool, direction, host layout, tokens, copy-kernel unroll):

  events_us  CUDA-event time of the operation, as transfer_bench.py reports it
  issue_us   host wall time to issue it, from an idle GPU (Python + launches)
  kernel_us  sum of its GPU kernels' durations (torch.profiler, i.e. CUPTI)
  span_us    first kernel start to last kernel end
  kernels    kernels per operation, and blocks: their distinct grid sizes

events ~ issue > kernel means the host bounds it; events ~ kernel means the kernels do.
`--unrolls default,1,2` also runs the JIT copy kernels at a forced unroll, every part
(1,152-byte MLA rows: SGLang 0.5.20 picks 1, patch 0008 2 from 65 rows up; 1,024-byte MHA
rows: both 2, which fills one block of 1,024 threads up to 64 rows where unroll 1 fills
two), medians of --reps.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transfer_bench as tb  # noqa: E402

TOKENS = [64, 256, 1024, 16384]


def issue_times(fn, reps):
    """Host seconds to issue fn(i), each from an idle GPU."""
    import torch
    times = []
    for i in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return times


def force_unroll(unroll):
    """Make SGLang's JIT HiCache wrappers pick `unroll` (None: their own choice)."""
    from sglang.kernels.ops.kvcache import hicache
    # 0.5.20 picks by row size (_default_unroll); patch 0008 also by batch (_unroll_for_batch).
    for name in ("_default_unroll", "_unroll_for_batch"):
        if hasattr(hicache, name):
            own = hicache.__dict__.setdefault(f"_own{name}", getattr(hicache, name))
            setattr(hicache, name, (lambda *args: unroll) if unroll else own)


def child(mode: str, reps: int, parts: list[str], unrolls: list[str], tokens: list[int]) -> list[dict]:
    import torch
    rows, gen = [tb.meta_row(mode, tb.import_sglang(mode))], torch.Generator().manual_seed(0)
    for part in parts:
        try:
            kv = tb.KVBench(part, gen, max_tokens=max(tokens), interleave=mode == "torch-interleaved")
        except Exception as exc:
            rows.append(dict(mode=mode, pool=part.upper(), error=f"{type(exc).__name__}: {exc}"[:300]))
            continue
        for layout in ("layer_first", "page_first"):
            host = kv.host_pool(layout)
            for n in tokens:
                backup, load, _ = kv.calls(host, n)
                for unroll in unrolls:
                    force_unroll(None if unroll == "default" else int(unroll))
                    for direction, fn in (("backup", backup), ("load", load)):
                        events = tb.cuda_times(fn, reps)
                        issue = issue_times(fn, reps)
                        prof = tb.kernel_profile(fn, 3)
                        med = lambda key: statistics.median(p[key] for p in prof)
                        rows.append(dict(
                            mode=mode, pool=part.upper(), direction=direction, host_layout=layout,
                            batch=n, unroll=unroll, events_us=statistics.median(events) * 1e6,
                            issue_us=statistics.median(issue) * 1e6, kernel_us=med("kernel_us"),
                            span_us=med("span_us"), kernels=med("kernels"), copies=med("copies"),
                            blocks=prof[0]["blocks"]))
            force_unroll(None)
            host.destroy()
        kv.release()
    return rows


def table(rows):
    lines = ["| variant | pool | dir | layout | tokens | unroll | events us | issue us | kernel us "
             "| span us | kernels | copies | blocks |", "|---|---|---|---|---:|---|" + "---:|" * 7]
    trees = tb.tree_lines(rows)
    for r in rows:
        if r.get("pool") == "meta":
            continue
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['pool']} | not measured: {r['error']} |")
            continue
        lines.append(
            f"| {r['mode']} | {r['pool']} | {r['direction']} | {r['host_layout']} | {r['batch']} | {r['unroll']} "
            f"| {r['events_us']:.1f} | {r['issue_us']:.1f} | {r['kernel_us']:.1f} | {r['span_us']:.1f} "
            f"| {r['kernels']:g} | {r['copies']:g} | {','.join(map(str, r['blocks']))} |")
    return "\n".join(trees + lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(tb.ROOT, "bench", "profile.json"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--parts", default="mla,mha")
    ap.add_argument("--modes", default="native,patched-dense,kvcached-contiguous")
    ap.add_argument("--unrolls", default="default,1,2")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--native-sglang", help="python/ folder of an unpatched SGLang 0.5.20, for the native variant")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        json.dump(child(args.child, args.reps, args.parts.split(","), args.unrolls.split(","),
                        [int(t) for t in args.tokens.split(",")]), sys.stdout)
        return
    import torch
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                reps=args.reps, page_size=tb.PAGE)
    rows = []
    for mode in args.modes.split(","):
        rows += tb.run_child(__file__, mode, args.native_sglang,
                             ["--reps", str(args.reps), "--parts", args.parts, "--unrolls", args.unrolls,
                              "--tokens", args.tokens])
        with open(args.out, "w") as handle:  # after every variant, as transfer_bench.py
            json.dump({"meta": meta, "rows": rows}, handle, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
