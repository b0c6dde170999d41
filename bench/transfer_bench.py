"""HiCache transfer throughput: native SGLang pools vs patched host pools over kvcached.

    python bench/transfer_bench.py --out bench/results.json    (on a CUDA machine)

Runs one child process per variant (kvcached decides at import time):

  native               SGLang 0.5.20 as released (--native-sglang: its python/ folder)
                       over its own dense pools: the baseline every ratio is taken to;
  patched-dense        the tree on PYTHONPATH (patched) over the same dense pools;
  kvcached-contiguous  the patched tree over kvcached's default layout;
  kvcached-per-layer   the patched tree over kvcached's one-buffer-per-layer layout.

Without --native-sglang, "native" runs the tree on PYTHONPATH too (and says so).
Each child builds the device pool for a model shape, fills it with random data, and
times through SGLang's host pools:

  backup = one backup_from_device_all_layer call (device -> pinned host, all layers)
  load   = load_to_device_per_layer for every layer (host -> device)

with CUDA events after warm-up (JIT compilation outside the timing), the median of
--reps repetitions, random non-contiguous pages, rotating index sets. It also times a
large pinned<->device copy, the link's practical limit. Prints a table last and writes
JSON; bench/plot.py draws it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODES = {
    "native": {"ENABLE_KVCACHED": "false"},
    "patched-dense": {"ENABLE_KVCACHED": "false"},
    "kvcached-contiguous": {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "true"},
    "kvcached-per-layer": {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "false"},
}
PAGE = 64
TOKENS = [64, 256, 1024, 4096, 16384, 65536]
SLOTS = [1, 4, 16, 64, 256]


def cuda_times(fn, reps, warmup=3):
    """Seconds per call, one per repetition, after warm-up (JIT compiled by then)."""
    import torch
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def timed_row(nbytes, times, **fields):
    """A result row: GB/s of the median repetition, and of the slowest and fastest."""
    return dict(fields, batch_bytes=nbytes, seconds=statistics.median(times),
                GBps=nbytes / statistics.median(times) / 1e9,
                GBps_min=nbytes / max(times) / 1e9, GBps_max=nbytes / min(times) / 1e9)


def loads_back_exactly(host, pool, views, layers, src, dst, host_backup, host_load) -> bool:
    """Back up device rows `src`, load them into `dst`: dst must then hold src's bytes."""
    import torch
    from tests.support.roundtrip import as_bytes
    before = [v[src].clone() for v in views]
    host.backup_from_device_all_layer(pool, host_backup, src, "kernel")
    for layer in range(layers):
        host.load_to_device_per_layer(pool, host_load, dst, layer, "kernel")
    torch.cuda.synchronize()
    return all(torch.equal(as_bytes(v[dst]), as_bytes(b)) for v, b in zip(views, before))


def series_applied(site: str) -> str:
    """What scripts/status says of the tree this child imports."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "status"), site],
                          capture_output=True, text=True)
    return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else proc.stderr.strip()[-200:]


def child(mode: str, reps: int, parts: list[str]) -> list[dict]:
    os.environ.update(MODES[mode])
    os.environ.setdefault("KVCACHED_PAGE_SIZE_MB", "4")
    import torch
    if mode.startswith("kvcached"):
        os.environ["KVCACHED_AUTOPATCH"] = "1"
        import kvcached.integration.sglang.autopatch  # noqa: F401
    import sglang
    import sglang.srt.distributed as dist
    dist.get_tensor_model_parallel_rank = lambda: 0
    dist.get_tensor_model_parallel_world_size = lambda: 1
    dist.get_pipeline_model_parallel_rank = lambda: 0

    rows, gen = [], torch.Generator().manual_seed(0)
    rows.append(dict(mode=mode, pool="meta", sglang=os.path.dirname(sglang.__file__),
                     series_applied=series_applied(os.path.dirname(os.path.dirname(sglang.__file__)))))

    def token_sets(total_pages, n_tokens, count=4, skip=1):
        sets = []
        for _ in range(count):
            pages = torch.randperm(total_pages - skip, generator=gen)[: n_tokens // PAGE] + skip
            sets.append((pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1))
        return sets

    def used_pages(pool, n_pages):
        if hasattr(pool, "kvcached_allocator"):
            pool.kvcached_allocator._wait_post_init()
            return torch.tensor(sorted(pool.kvcached_allocator.alloc(n_pages)))
        return torch.arange(1, n_pages + 1)

    if mode == "native" and "link" in parts:
        nbytes = 1 << 30
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        rows.append(timed_row(nbytes, cuda_times(lambda i: host.copy_(dev, non_blocking=True), reps),
                              mode="pinned-copy", pool="link", direction="backup", host_layout="-", batch=nbytes))
        rows.append(timed_row(nbytes, cuda_times(lambda i: dev.copy_(host, non_blocking=True), reps),
                              mode="pinned-copy", pool="link", direction="load", host_layout="-", batch=nbytes))
        del host, dev

    for part in [p for p in ("mha", "mla") if p in parts]:
        try:
            rows += kv_part(part, mode, reps, gen, token_sets, used_pages)
        except Exception as exc:  # e.g. kvcached 0.1.6 cannot build per-layer MLA pools
            rows.append(dict(mode=mode, pool=part.upper(), error=f"{type(exc).__name__}: {exc}"[:300]))
            torch.cuda.empty_cache()
    if "mamba" in parts:
        rows += mamba_part(mode, reps, gen)
    return rows


def kv_part(part, mode, reps, gen, token_sets, used_pages):
    import torch
    from sglang.srt.mem_cache import memory_pool as mp
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from tests.support.models import DEEPSEEK_V2_LITE, QWEN25_7B
    bf, rows, max_tokens = torch.bfloat16, [], max(TOKENS)
    if True:
        n_pages = max_tokens // PAGE + 8
        size = (n_pages + 64) * PAGE  # kvcached keeps a few blocks back
        if part == "mha":
            s = QWEN25_7B
            pool = mp.MHATokenToKVPool(size=size, page_size=PAGE, dtype=bf, head_num=s.kv_heads, head_dim=s.head_dim,
                                       layer_num=s.layers, device="cuda", enable_memory_saver=False)
            views, row_bytes, layers = [*pool.k_buffer, *pool.v_buffer], s.kv_heads * s.head_dim * 2 * 2, s.layers
            host_cls = MHATokenToKVPoolHost
        else:
            s = DEEPSEEK_V2_LITE
            pool = mp.MLATokenToKVPool(size=size, page_size=PAGE, dtype=bf, kv_lora_rank=s.kv_lora_rank,
                                       qk_rope_head_dim=s.qk_rope_head_dim, layer_num=s.layers, device="cuda",
                                       enable_memory_saver=False)
            views, row_bytes, layers = list(pool.kv_buffer), s.kv_dim * 2, s.layers
            host_cls = MLATokenToKVPoolHost
        pages = used_pages(pool, n_pages)
        tokens = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1).cuda()
        for v in views:
            v[tokens] = torch.randn((tokens.numel(), *v.shape[1:]), device="cuda").to(v.dtype)
        for layout in ("layer_first", "page_first"):
            host = host_cls(pool, 1.0, 0, PAGE, layout, pin_memory=True, device="cpu")
            for n in TOKENS:
                dev_sets = [pages[t // PAGE] * PAGE + t % PAGE for t in token_sets(len(pages), n, skip=0)]
                dev_sets = [d.cuda() for d in dev_sets]
                host_sets = token_sets(host.size // PAGE, n)
                host_bk = [h if host.can_use_write_back_jit else h.cuda() for h in host_sets]
                host_ld = [h.cuda() for h in host_sets]
                nbytes = n * row_bytes * layers
                k = len(dev_sets)
                t_b = cuda_times(lambda i: host.backup_from_device_all_layer(pool, host_bk[i % k], dev_sets[i % k], "kernel"), reps)

                def load(i):
                    for layer in range(layers):
                        host.load_to_device_per_layer(pool, host_ld[i % k], dev_sets[i % k], layer, "kernel")
                t_l = cuda_times(load, reps)
                for direction, t in (("backup", t_b), ("load", t_l)):
                    rows.append(timed_row(nbytes, t, mode=mode, pool=part.upper(), direction=direction,
                                          host_layout=layout, batch=n))
                if n == 4096:  # the timed path must also be the right one
                    ok = loads_back_exactly(host, pool, views, layers, dev_sets[0], dev_sets[1], host_bk[0], host_ld[0])
                    rows.append(dict(mode=mode, pool=part.upper(), host_layout=layout, batch=n, byte_exact=ok))
            host.destroy()
        del pool, views
        torch.cuda.empty_cache()
    return rows


def mamba_part(mode, reps, gen):
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache import memory_pool as mp
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from tests.support.models import QWEN35_4B
    bf, rows = torch.bfloat16, []
    if True:
        m = QWEN35_4B
        shape = Mamba2StateShape.create(**m.state_shape_kwargs())
        params = Mamba2CacheParams(shape=shape, layers=m.linear_layers,
                                   dtype=Mamba2StateDType(conv=bf, temporal=torch.float32))
        slots = max(SLOTS) + 16  # kvcached keeps a few slots back
        pool = mp.MambaPool(size=slots, spec_state_size=slots, cache_params=params,
                            mamba_layer_ids=list(range(len(m.linear_layers))), device="cuda")
        if hasattr(pool, "kvcached_allocator"):
            pool.kvcached_allocator._wait_post_init()
        # Elastic pools allocate slots themselves; SGLang's own pool leaves that to
        # its HybridReqToTokenPool, so take slots 1..n (0 is the null slot) there.
        used = (pool.alloc(max(SLOTS)) if hasattr(pool, "alloc") else torch.arange(1, max(SLOTS) + 1)).cuda()
        layers = len(m.linear_layers)
        for l in range(layers):
            st = pool.mamba_cache.at_layer_idx(l)
            st.temporal[used] = torch.randn((used.numel(), *st.temporal.shape[1:]), device="cuda")
            st.conv[0][used] = torch.randn((used.numel(), *st.conv[0].shape[1:]), device="cuda").to(bf)
        host = MambaPoolHost(pool, 1.05, 0, pin_memory=True, device="cpu", layout="page_first")
        per_slot = host.size_per_token
        for n in SLOTS:
            dev_sets = [used[torch.randperm(used.numel(), generator=gen)[:n].cuda()] for _ in range(4)]
            host_sets = [torch.randperm(host.size - 1, generator=gen)[:n] + 1 for _ in range(4)]
            host_ld = [h.cuda() for h in host_sets]
            t_b = cuda_times(lambda i: host.backup_from_device_all_layer(pool, host_sets[i % 4], dev_sets[i % 4], "kernel"), reps)

            def load(i):
                for layer in range(layers):
                    host.load_to_device_per_layer(pool, host_ld[i % 4], dev_sets[i % 4], layer, "kernel")
            t_l = cuda_times(load, reps)
            for direction, t in (("backup", t_b), ("load", t_l)):
                rows.append(timed_row(n * per_slot, t, mode=mode, pool="Mamba", direction=direction,
                                      host_layout="page_first", batch=n))
            if n == 16:
                states = [pool.mamba_cache.at_layer_idx(l) for l in range(layers)]
                views = [s.temporal for s in states] + [c for s in states for c in s.conv]
                ok = loads_back_exactly(host, pool, views, layers, dev_sets[0], dev_sets[1], host_sets[0], host_ld[0])
                rows.append(dict(mode=mode, pool="Mamba", host_layout="page_first", batch=n, byte_exact=ok))
    return rows


VARIANTS = ("native", "patched-dense", "kvcached-contiguous", "kvcached-per-layer")


def table(rows: list[dict]) -> str:
    """GB/s per variant, each variant's ratio to native, and native's share of the link."""
    all_rows = rows
    errors = [f"{r['mode']} {r['pool']}: {r['error']}" for r in rows if "error" in r]
    trees = [f"{r['mode']}: {r['sglang']} ({r['series_applied']})" for r in rows if r.get("pool") == "meta"]
    rows = [r for r in rows if "GBps" in r]
    link = {r["direction"]: r["GBps"] for r in rows if r["pool"] == "link"}
    by = {(r["mode"], r["pool"], r["direction"], r["host_layout"], r["batch"]): r["GBps"] for r in rows}
    keys = sorted({(r["pool"], r["direction"], r["host_layout"], r["batch"]) for r in rows if r["pool"] != "link"})
    short = {"native": "native", "patched-dense": "dense", "kvcached-contiguous": "contig",
             "kvcached-per-layer": "per-layer"}
    head = " | ".join(f"{short[v]} GB/s" for v in VARIANTS)
    ratios = " | ".join(f"{short[v]}/native" for v in VARIANTS[1:])
    lines = [f"| pool | dir | host layout | batch | {head} | {ratios} | native/link |",
             "|---|---|---|---:|" + "---:|" * (2 * len(VARIANTS))]
    f = lambda x: f"{x:.2f}" if x is not None else "-"
    for key in keys:
        values = [by.get((v, *key)) for v in VARIANTS]
        nat = values[0]
        rel = [f"{x / nat:.2f}" if x is not None and nat else "-" for x in values[1:]]
        of_link = f"{nat / link[key[1]]:.2f}" if nat and key[1] in link else "-"
        lines.append(f"| {' | '.join(map(str, key))} | {' | '.join(map(f, values))} | {' | '.join(rel)} | {of_link} |")
    lines += [f"not measured: {e}" for e in errors]
    checks = [r for r in all_rows if "byte_exact" in r]
    bad = [f"{r['mode']} {r['pool']} {r['host_layout']}" for r in checks if not r["byte_exact"]]
    lines.append(f"byte-exact load-back checks: {len(checks) - len(bad)} of {len(checks)} pass"
                 + (f"; FAILED: {', '.join(bad)}" if bad else ""))
    lines += [f"tree: {t}" for t in trees]
    lines.append(f"\npinned copy (1 GiB): D2H {link.get('backup', 0):.1f} GB/s, H2D {link.get('load', 0):.1f} GB/s")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results.json"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--parts", default="link,mha,mla,mamba")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--native-sglang", help="python/ folder of an unpatched SGLang 0.5.20, for the native variant")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    parts = args.parts.split(",")
    if args.child:
        json.dump(child(args.child, args.reps, parts), sys.stdout)
        return
    import torch
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                reps=args.reps, page_size=PAGE)
    rows = []
    for mode in args.modes.split(","):
        t = time.time()
        env = dict(os.environ)
        if mode == "native" and args.native_sglang:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.native_sglang, env.get("PYTHONPATH")]))
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--reps", str(args.reps),
                               "--parts", args.parts], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"{mode}: benchmark child failed")
        rows += json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{mode}: {time.time() - t:.0f} s", file=sys.stderr)
        with open(args.out, "w") as handle:  # after every variant: a cut-short run keeps what it measured
            json.dump({"meta": meta, "rows": rows}, handle, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
