"""Loads into kvcached's mapped memory against loads into torch's, in one process.

    python bench/kvcached_memory.py --out bench/kvcached-memory.json    (on a CUDA machine)

transfer_bench.py compares variants across processes. Its small page_first loads into
kvcached pools take 0-13% more GPU time than native's in some processes and none in
others, while a kvcached per-layer pool has dense per-layer views, so SGLang runs
native's kernel and grid on it. This separates the memory from the process: per process
kind (a child each: kvcached in either layout; or "native", kvcached off, SGLang's own
dense pool, the control; every child imports the tree on PYTHONPATH), it builds the
pool as transfer_bench.py does, and a twin of its per-layer views in torch's memory
(the same strides, the rows a load can write, an allocation per view), then times
SGLang's load of every layer (page_first host pool, random host pages) into one and the
other, alternating, --reps times per batch (GPU time of the kernels, torch.profiler).
Each batch ends with a check that both targets hold the same rows after the same load,
so the twin really was written.

With --series S it asks when instead: per process and pool, 64-token loads back to back
for S seconds from the pool's construction, alternating between the two memories, each
with the seconds since the pool was built and the SM clock read after it (--processes
may name a kind more than once, for more processes of it).
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

TOKENS = [64, 256, 1024]
SERIES_BATCH = 64
# process kind -> transfer_bench mode; "native": SGLang's own pool in a process without kvcached
PROCESSES = {"native": "native", "contiguous": "kvcached-contiguous", "per-layer": "kvcached-per-layer"}


def rows_a_load_can_write(pages) -> int:
    """Rows up to the end of the highest page a batch can take (KVBench.index_sets draws
    device pages from kv.pages, each PAGE rows)."""
    return (int(max(pages)) + 1) * tb.PAGE


def torch_twin(views, rows: int):
    """Views of torch's memory with each view's strides and its first `rows` rows
    (kvcached's views span its whole virtual reservation)."""
    import torch
    return [torch.empty_strided((rows, *v.shape[1:]), v.stride(), dtype=v.dtype, device=v.device) for v in views]


def point_at(kv, views):
    """Make kv's pool load into `views` (as many as kv.views, in _views_of's order)."""
    if kv.part == "mha":
        half = len(views) // 2
        kv.pool.k_buffer, kv.pool.v_buffer = list(views[:half]), list(views[half:])
    else:
        kv.pool.kv_buffer = list(views)


def loads_into_both(kv, host, n, mapped, twin):
    """load(target, i): every layer of the i-th rotating index set into `mapped` (the
    pool's own views) when target is "pool", else into `twin`; and check(): whether both
    hold a backed-up batch's bytes after each has loaded it."""
    import torch
    dev, host_backup, host_load = kv.index_sets(host, n)

    def load(target, i):
        point_at(kv, mapped if target == "pool" else twin)
        tb.load_all_layers(host, kv.pool, host_load[i % len(dev)], dev[i % len(dev)], kv.layers)

    def check():
        point_at(kv, mapped)
        for v in mapped:   # fresh rows: the timed loads may have left both targets alike
            v[dev[1]] = torch.randn((dev[1].numel(), *v.shape[1:]), device=v.device).to(v.dtype)
        before = [v[dev[1]].clone() for v in mapped]
        host.backup_from_device_all_layer(kv.pool, host_backup[0], dev[1], "kernel")
        for target in ("pool", "twin"):
            load(target, 0)   # set 0: host_load[0] is host_backup[0]; rows dev[0]
        point_at(kv, mapped)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return all(torch.equal(m[dev[0]], b) and torch.equal(t[dev[0]], b) for m, t, b in zip(mapped, twin, before))

    return load, check


def time_loads(kv, host, mapped, twin, reps: int) -> list[dict]:
    """Per batch: GPU microseconds of each alternating load into the pool's memory and
    into the twin, and the byte check."""
    cells = []
    for n in TOKENS:
        load, check = loads_into_both(kv, host, n, mapped, twin)
        for target in ("pool", "twin"):   # warm-up: JIT builds outside the timing
            load(target, 0)
        gpu_us = {"pool": [], "twin": []}
        for i in range(reps):   # alternating, so drift over the run hits both alike
            for target in (("pool", "twin") if i % 2 == 0 else ("twin", "pool")):
                (profiled,) = tb.kernel_profile(lambda _: load(target, i), 1)
                gpu_us[target].append(profiled["kernel_us"])
        cells.append(dict(batch=n, pool_us=gpu_us["pool"], twin_us=gpu_us["twin"], both_loaded_the_bytes=check()))
    return cells


def sm_clock_mhz():
    """The GPU's SM clock now (NVML), or None where it cannot be read."""
    import torch
    try:
        return torch.cuda.clock_rate()
    except Exception:   # no NVML binding: the series still has its times
        return None


def load_series(kv, host, mapped, twin, seconds: float, built: float) -> dict:
    """SERIES_BATCH-token loads of every layer, alternating pool / twin, back to back until
    `seconds` after `built` (time.monotonic() when the pool was constructed): per load, its
    seconds since then, target, GPU microseconds and the SM clock after it; and the check."""
    load, check = loads_into_both(kv, host, SERIES_BATCH, mapped, twin)
    samples, i = [], 0
    while time.monotonic() - built < seconds:
        target = "pool" if i % 2 == 0 else "twin"
        (profiled,) = tb.kernel_profile(lambda _: load(target, i), 1)
        samples.append(dict(t_s=round(time.monotonic() - built, 3), target=target, gpu_us=profiled["kernel_us"],
                            sm_mhz=sm_clock_mhz()))
        i += 1
    return dict(batch=SERIES_BATCH, samples=samples, both_loaded_the_bytes=check())


def child(process: str, reps: int, parts: list[str], series: float = 0.0) -> list[dict]:
    import torch
    sglang = tb.import_sglang(PROCESSES[process])
    rows, gen = [], torch.Generator().manual_seed(0)
    tree = os.path.dirname(sglang.__file__)   # which SGLang the rows are of
    for part in parts:
        built = time.monotonic()
        kv = tb.KVBench(part, gen, max_tokens=max(TOKENS))
        mapped = list(kv.views)
        twin = torch_twin(mapped, rows_a_load_can_write(kv.pages))
        host = kv.host_pool("page_first")
        where = dict(process=process, pool=part.upper(), direction="load", host_layout="page_first", sglang=tree)
        if series:
            rows.append(dict(where, **load_series(kv, host, mapped, twin, series, built)))
        else:
            rows += [dict(where, **cell) for cell in time_loads(kv, host, mapped, twin, reps)]
        host.destroy()
        kv.release()
        del mapped, twin
        torch.cuda.empty_cache()   # before the next part's pool and twin
    return rows


def table(rows: list[dict]) -> str:
    """Per cell: the median GPU time into the pool's memory and into the torch twin, their
    ratio twin / pool (under 1.00: the pool's memory is slower), and in how many
    alternations the pool's was slower."""
    lines = ["| process | pool | batch | pool's memory us | torch twin us | twin/pool | pool slower in | bytes |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        pool, twin = statistics.median(r["pool_us"]), statistics.median(r["twin_us"])
        slower = sum(a > b for a, b in zip(r["pool_us"], r["twin_us"]))
        lines.append(f"| {r['process']} | {r['pool']} | {r['batch']} | {pool:.1f} | {twin:.1f} | {twin / pool:.3f} "
                     f"| {slower} of {len(r['pool_us'])} | {'same' if r['both_loaded_the_bytes'] else 'DIFFER'} |")
    return "\n".join(lines)


def series_table(rows: list[dict], seconds: float, window_s: float = 2.0) -> str:
    """Per process (in run order), pool and window of `window_s` seconds since the pool was
    built: how many loads, the median GPU time into each memory, and the SM clock range.
    Loads that ended after the series' `seconds` are left out (a last window would hold one
    or two); a pool whose setup took all of them says so."""
    lines = ["| process | run | pool | seconds | loads | pool's memory us | torch twin us | SM MHz | bytes |",
             "|---|---:|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        windows: dict[int, list[dict]] = {}
        for s in r["samples"]:
            if s["t_s"] <= seconds:
                windows.setdefault(int(s["t_s"] // window_s), []).append(s)
        if not windows:
            lines.append(f"| {r['process']} | {r['run']} | {r['pool']} | 0-{seconds:g} | 0 | - | - | - "
                         f"| no load within {seconds:g} s of the pool's construction |")
        for w, samples in sorted(windows.items()):
            us = {t: [s["gpu_us"] for s in samples if s["target"] == t] for t in ("pool", "twin")}
            mhz = [s["sm_mhz"] for s in samples if s["sm_mhz"] is not None]
            lines.append(f"| {r['process']} | {r['run']} | {r['pool']} | {w * window_s:g}-{(w + 1) * window_s:g} "
                         f"| {len(samples)} | "
                         + " | ".join(f"{statistics.median(us[t]):.1f}" if us[t] else "-" for t in ("pool", "twin"))
                         + f" | {f'{min(mhz)}-{max(mhz)}' if mhz else '-'} "
                         f"| {'same' if r['both_loaded_the_bytes'] else 'DIFFER'} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(tb.ROOT, "bench", "kvcached-memory.json"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--parts", default="mha,mla", help="any of mha,mla")
    ap.add_argument("--processes", default=",".join(PROCESSES),
                    help=f"any of {','.join(PROCESSES)}, in run order, each as often as wanted")
    ap.add_argument("--series", type=float, default=0.0,
                    help="seconds of 64-token loads from each pool's construction, instead of the batches")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    parts, processes = args.parts.split(","), args.processes.split(",")
    if set(parts) - {"mha", "mla"} or set(processes) - set(PROCESSES):
        ap.error(f"--parts: mha,mla; --processes: {','.join(PROCESSES)}")
    if args.child:
        json.dump(child(args.child, args.reps, parts, args.series), sys.stdout)
        return
    import torch
    rows = []
    for run, process in enumerate(processes):   # a fresh process each: kvcached patches SGLang at import time
        started = time.time()
        rows += [dict(row, run=run, started=started) for row in tb.run_child(
            __file__, process, None, ["--reps", str(args.reps), "--parts", args.parts, "--series", str(args.series)])]
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                reps=args.reps, series_s=args.series, page_size=tb.PAGE,
                kvcached_page_mb=os.environ.get("KVCACHED_PAGE_SIZE_MB", "4"))
    with open(args.out, "w") as handle:
        json.dump({"meta": meta, "rows": rows}, handle, indent=1)
    print(series_table(rows, args.series) if args.series else table(rows))


if __name__ == "__main__":
    main()
