"""HiCache transfer throughput: native SGLang pools vs patched host pools over kvcached.

    python bench/transfer_bench.py --out bench/results.json    (on a CUDA machine)

Runs one child process per device-pool kind (kvcached decides at import time):
native SGLang pools (dense), kvcached contiguous layout, kvcached per-layer layout.
Each child builds the device pool for a model shape, fills it with random data, and
times through SGLang's host pools (the patched ones when the series is applied):

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
    "kvcached-contiguous": {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "true"},
    "kvcached-per-layer": {"ENABLE_KVCACHED": "true", "KVCACHED_CONTIGUOUS_LAYOUT": "false"},
}
PAGE = 64
TOKENS = [64, 256, 1024, 4096, 16384, 65536]
SLOTS = [1, 4, 16, 64]


def cuda_median(fn, reps, warmup=3):
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
    return statistics.median(times)


def child(mode: str, reps: int, parts: list[str]) -> list[dict]:
    os.environ.update(MODES[mode])
    os.environ.setdefault("KVCACHED_PAGE_SIZE_MB", "4")
    import torch
    if mode != "native":
        os.environ["KVCACHED_AUTOPATCH"] = "1"
        import kvcached.integration.sglang.autopatch  # noqa: F401
    import sglang  # noqa: F401
    import sglang.srt.distributed as dist
    dist.get_tensor_model_parallel_rank = lambda: 0
    dist.get_tensor_model_parallel_world_size = lambda: 1
    dist.get_pipeline_model_parallel_rank = lambda: 0
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache import memory_pool as mp
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from tests.support.models import DEEPSEEK_V2_LITE, QWEN25_7B, QWEN35_4B

    rows, gen = [], torch.Generator().manual_seed(0)
    bf = torch.bfloat16

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

    max_tokens = max(TOKENS)
    if mode == "native" and "link" in parts:
        nbytes = 1 << 30
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        rows.append(dict(mode="pinned-copy", pool="link", direction="backup", host_layout="-", batch=nbytes,
                         GBps=nbytes / cuda_median(lambda i: host.copy_(dev, non_blocking=True), reps) / 1e9))
        rows.append(dict(mode="pinned-copy", pool="link", direction="load", host_layout="-", batch=nbytes,
                         GBps=nbytes / cuda_median(lambda i: dev.copy_(host, non_blocking=True), reps) / 1e9))
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
                dev_sets = [pages[(t // PAGE).clamp(max=len(pages) - 1)] * PAGE + t % PAGE
                            for t in token_sets(n_pages + 1, n, skip=0)]
                dev_sets = [d.cuda() for d in dev_sets]
                host_sets = token_sets(host.size // PAGE, n)
                host_bk = [h if host.can_use_write_back_jit else h.cuda() for h in host_sets]
                host_ld = [h.cuda() for h in host_sets]
                nbytes = n * row_bytes * layers
                k = len(dev_sets)
                t_b = cuda_median(lambda i: host.backup_from_device_all_layer(pool, host_bk[i % k], dev_sets[i % k], "kernel"), reps)

                def load(i):
                    for layer in range(layers):
                        host.load_to_device_per_layer(pool, host_ld[i % k], dev_sets[i % k], layer, "kernel")
                t_l = cuda_median(load, reps)
                for direction, t in (("backup", t_b), ("load", t_l)):
                    rows.append(dict(mode=mode, pool=part.upper(), direction=direction, host_layout=layout,
                                     batch=n, seconds=t, GBps=nbytes / t / 1e9))
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
        slots = max(SLOTS) + 2
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
            t_b = cuda_median(lambda i: host.backup_from_device_all_layer(pool, host_sets[i % 4], dev_sets[i % 4], "kernel"), reps)

            def load(i):
                for layer in range(layers):
                    host.load_to_device_per_layer(pool, host_ld[i % 4], dev_sets[i % 4], layer, "kernel")
            t_l = cuda_median(load, reps)
            for direction, t in (("backup", t_b), ("load", t_l)):
                rows.append(dict(mode=mode, pool="Mamba", direction=direction, host_layout="page_first",
                                 batch=n, seconds=t, GBps=n * per_slot / t / 1e9))
    return rows


def table(rows: list[dict]) -> str:
    errors = [f"{r['mode']} {r['pool']}: {r['error']}" for r in rows if "error" in r]
    rows = [r for r in rows if "GBps" in r]
    link = {r["direction"]: r["GBps"] for r in rows if r["pool"] == "link"}
    native = {(r["pool"], r["direction"], r["host_layout"], r["batch"]): r["GBps"] for r in rows if r["mode"] == "native"}
    lines = ["| pool | dir | host layout | batch | native GB/s | contiguous GB/s | per-layer GB/s | contig/native | per-layer/native | native/link |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    keys = sorted({(r["pool"], r["direction"], r["host_layout"], r["batch"]) for r in rows if r["pool"] != "link"},
                  key=lambda k: (k[0], k[1], k[2], k[3]))
    by = {(r["mode"], r["pool"], r["direction"], r["host_layout"], r["batch"]): r["GBps"] for r in rows}
    for key in keys:
        nat = native.get(key)
        c = by.get(("kvcached-contiguous", *key))
        p = by.get(("kvcached-per-layer", *key))
        f = lambda x: f"{x:.2f}" if x is not None else "-"
        ratio = lambda x: f"{x / nat:.2f}" if x is not None and nat else "-"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {f(nat)} | {f(c)} | {f(p)} | {ratio(c)} | {ratio(p)} | "
                     f"{(nat / link[key[1]]) if nat and key[1] in link else 0:.2f} |")
    lines += [f"not measured: {e}" for e in errors]
    lines.append(f"\npinned copy (1 GiB): D2H {link.get('backup', 0):.1f} GB/s, H2D {link.get('load', 0):.1f} GB/s")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results.json"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--parts", default="link,mha,mla,mamba")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    parts = args.parts.split(",")
    if args.child:
        json.dump(child(args.child, args.reps, parts), sys.stdout)
        return
    rows = []
    for mode in args.modes.split(","):
        t = time.time()
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--reps", str(args.reps),
                               "--parts", args.parts], capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"{mode}: benchmark child failed")
        rows += json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{mode}: {time.time() - t:.0f} s", file=sys.stderr)
    import torch
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                reps=args.reps, page_size=PAGE)
    with open(args.out, "w") as handle:
        json.dump({"meta": meta, "rows": rows}, handle, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
