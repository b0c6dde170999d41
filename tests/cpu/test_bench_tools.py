"""The benchmark's own logic, without a GPU: what its tables and forced unrolls claim.

bench/RESULTS.md reads ratios out of transfer_bench.table() and compares kernels at
unrolls that profile_transfers.force_unroll() imposes; both must say what ran.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import profile_transfers  # noqa: E402
import transfer_bench  # noqa: E402


def row(mode, gbps, kernel_us=None, batch=64):
    r = dict(mode=mode, pool="MLA", direction="load", host_layout="layer_first", batch=batch, GBps=gbps)
    return r if kernel_us is None else dict(r, kernel_us=kernel_us)


def test_table_gives_event_and_gpu_time_ratios_to_native():
    rows = [dict(mode="pinned-copy", pool="link", direction="load", host_layout="-", batch=1 << 30, GBps=50.0),
            row("native", 5.0, kernel_us=110.0), row("kvcached-contiguous", 4.0, kernel_us=100.0),
            row("patched-dense", 6.0)]
    line = next(l for l in transfer_bench.table(rows).splitlines() if l.startswith("| MLA"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    # dense/native: events only (no GPU time); contig/native: 4/5 by events, 110/100 by GPU time
    assert cells[8:11] == ["1.20", "0.80 (1.10)", "-"]
    # each variant's share of the 50 GB/s link: native, dense, contig, per-layer (not run)
    assert cells[11:15] == ["0.10", "0.12", "0.08", "-"]
    header = transfer_bench.table(rows).splitlines()[0]
    assert header.count("|") == len(cells) + 1 and header.endswith("| contig/link | per-layer/link |")


def test_default_run_is_the_four_variants_the_table_shows():
    assert set(transfer_bench.VARIANTS) <= set(transfer_bench.MODES)
    assert "torch-interleaved" in transfer_bench.MODES and "torch-interleaved" not in transfer_bench.VARIANTS


@pytest.fixture
def launches(monkeypatch):
    from sglang.kernels.ops.kvcache import hicache

    unrolls = []

    def module(*, element_size, unroll, block_quota):
        return type("Module", (), {"launch_one_mla": staticmethod(lambda *args: unrolls.append(unroll))})

    monkeypatch.setattr(hicache, "_jit_hicache_module", module)
    for name in ("_default_unroll", "_unroll_for_batch"):  # force_unroll rebinds them
        if hasattr(hicache, name):
            monkeypatch.setattr(hicache, name, getattr(hicache, name))
    yield hicache, unrolls
    profile_transfers.force_unroll(None)


def test_forced_unroll_reaches_the_kernel_launch(launches):
    hicache, unrolls = launches
    rows = torch.zeros(4096, 1, 576, dtype=torch.bfloat16)
    index = torch.arange(4096)

    def one_layer():
        hicache.transfer_hicache_one_layer_mla(cache_dst=rows, indices_dst=index, cache_src=rows.clone(),
                                               indices_src=index)

    for forced in (1, 2, 4):
        profile_transfers.force_unroll(forced)
        one_layer()
    profile_transfers.force_unroll(None)
    one_layer()
    assert unrolls[:3] == [1, 2, 4]
    assert unrolls[3] == hicache._default_unroll(1152)  # the tree's own choice back
