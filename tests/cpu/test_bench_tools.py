"""bench/transfer_bench.py without a GPU: what its tables claim and what its CLI refuses."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
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


def test_rounds_alternate_which_variant_runs_first():
    order = transfer_bench.round_order(["native", "patched-dense", "kvcached-contiguous"], 3)
    assert order == [(0, "native"), (0, "patched-dense"), (0, "kvcached-contiguous"),
                     (1, "kvcached-contiguous"), (1, "patched-dense"), (1, "native"),
                     (2, "native"), (2, "patched-dense"), (2, "kvcached-contiguous")]


def test_table_of_several_rounds_takes_each_cells_median():
    link = dict(mode="pinned-copy", pool="link", direction="load", host_layout="-", batch=1 << 30)
    check = dict(mode="kvcached-contiguous", pool="MLA", host_layout="layer_first", batch=4096)
    rounds = [[dict(link, GBps=50.0), row("native", 5.0, kernel_us=110.0), row("kvcached-contiguous", 4.0, kernel_us=100.0),
               dict(check, byte_exact=True)],
              [dict(link, GBps=40.0), row("native", 9.0, kernel_us=90.0), row("kvcached-contiguous", 6.0, kernel_us=120.0),
               dict(check, byte_exact=False)],
              [dict(link, GBps=45.0), row("native", 6.0, kernel_us=100.0), row("kvcached-contiguous", 5.0, kernel_us=80.0),
               dict(check, byte_exact=True), dict(mode="kvcached-per-layer", pool="MLA", error="boom")]]
    rows = [dict(r, round=i) for i, rs in enumerate(rounds) for r in rs]
    merged = transfer_bench.merge_rounds(rows)
    assert len(merged) == 5
    contig = next(r for r in merged if r["mode"] == "kvcached-contiguous" and "GBps" in r)
    assert (contig["GBps"], contig["kernel_us"], contig["rounds"]) == (5.0, 100.0, 3) and "round" not in contig
    text = transfer_bench.table(rows)
    cells = [c.strip() for c in next(l for l in text.splitlines() if l.startswith("| MLA")).strip("|").split("|")]
    # medians: native 6.0 GB/s over 100 us, contig 5.0 over 100 us, link 45
    assert cells[4:7] == ["6.00", "-", "5.00"] and cells[9] == "0.83 (1.00)" and cells[11] == "0.13"
    # the check failed in one round: it fails; the error of one round is still reported
    assert "byte-exact load-back checks: 0 of 1 pass" in text and "not measured: kvcached-per-layer MLA: boom" in text
    assert "median over its 3 rounds" in text
    # a one-round run is tabled as before
    assert "rounds" not in transfer_bench.table([dict(r) for r in rounds[0]])


def test_merged_rounds_keep_cells_apart_and_take_gbps_from_the_median_time():
    # two batches, both directions, two host layouts: each cell merges only its own rounds
    def timed(direction, layout, batch, seconds, span_us):
        return dict(mode="native", pool="MHA", direction=direction, host_layout=layout, batch=batch,
                    batch_bytes=1e9, seconds=seconds, GBps=1 / seconds, GBps_min=0.0, span_us=span_us)
    cells = [(d, layout, b) for d in ("backup", "load") for layout in ("page_first", "layer_first") for b in (64, 256)]
    rows = [dict(timed(*cell, seconds=(k + 1) * (r + 1), span_us=10.0 * (k + 1) + r), round=r)
            for r in range(4) for k, cell in enumerate(cells)]
    merged = transfer_bench.merge_rounds(rows)
    assert len(merged) == len(cells)
    for k, cell in enumerate(cells):
        (out,) = [m for m in merged if (m["direction"], m["host_layout"], m["batch"]) == cell]
        # rounds took (k+1) * 1, 2, 3, 4 s: median 2.5 (k+1) s; GB/s of that time, not the median of GB/s
        assert out["seconds"] == 2.5 * (k + 1) and out["GBps"] == 1 / (2.5 * (k + 1))
        assert out["span_us"] == 10.0 * (k + 1) + 1.5 and out["rounds"] == 4
        assert "GBps_min" not in out and "round" not in out


def test_default_run_is_the_four_variants_the_table_shows():
    assert set(transfer_bench.VARIANTS) <= set(transfer_bench.MODES)
    assert "torch-interleaved" in transfer_bench.MODES and "torch-interleaved" not in transfer_bench.VARIANTS


@pytest.mark.parametrize("runs", [False, True])
def test_token_sets_are_whole_pages_in_range_random_or_one_run(runs):
    gen = torch.Generator().manual_seed(0)
    sets = transfer_bench.token_sets(gen, total_pages=40, n_tokens=8 * transfer_bench.PAGE, count=20, runs=runs)
    starts = set()
    for tokens in sets:
        pages = (tokens[:: transfer_bench.PAGE] // transfer_bench.PAGE).tolist()
        assert tokens.tolist() == [p * transfer_bench.PAGE + t for p in pages for t in range(transfer_bench.PAGE)]
        assert len(set(pages)) == 8 and 1 <= min(pages) and max(pages) < 40   # page 0 skipped
        consecutive = pages == list(range(pages[0], pages[0] + 8))
        assert consecutive if runs else not consecutive
        starts.add(pages[0])
    assert len(starts) > 5   # runs start at random pages, not always at the first


class FakeServingChild:
    """A serving child that offers `cells` and answers each ask with the cell and mode."""

    def __init__(self, mode, cells, events):
        self.mode, self.cells, self.events = mode, cells, events
        events.append(("start", mode))

    def receive(self):
        self.events.append(("hello", self.mode))
        return dict(rows=[dict(mode=self.mode, pool="meta")], cells=[list(c) for c in self.cells])

    def ask(self, cell):
        self.events.append(("ask", self.mode, cell))
        if cell == ("MLA", "load", "page_first", 64) and self.mode == "broken":
            raise SystemExit("broken: benchmark child failed")
        return dict(mode=self.mode, pool=cell[0], direction=cell[1], host_layout=cell[2], batch=cell[3])

    def finish(self):
        self.events.append(("finish", self.mode))
        return [dict(mode=self.mode, pool="MHA", byte_exact=True, after="every cell")]

    def close(self):
        self.events.append(("close", self.mode))


LINK = ("link", "backup", "-", 1 << 30)
A, B = ("MHA", "load", "page_first", 64), ("MLA", "load", "page_first", 64)


def test_cell_by_cell_times_each_cell_in_all_rounds_and_variants_before_the_next():
    events, saved = [], []
    offers = {"native": [LINK, A, B], "patched-dense": [A, B], "kvcached-contiguous": [A]}
    rows = transfer_bench.cell_by_cell_rows(list(offers), 2, lambda m: FakeServingChild(m, offers[m], events),
                                           save=lambda rows: saved.append(len(rows)))
    # started one after another, each set up (hello) before the next starts
    assert events[:6] == [("start", "native"), ("hello", "native"), ("start", "patched-dense"),
                          ("hello", "patched-dense"), ("start", "kvcached-contiguous"),
                          ("hello", "kvcached-contiguous")]
    asks = [(e[1], e[2]) for e in events if e[0] == "ask"]
    assert asks == [("native", LINK), ("native", LINK),
                    ("native", A), ("patched-dense", A), ("kvcached-contiguous", A),
                    ("kvcached-contiguous", A), ("patched-dense", A), ("native", A),
                    ("native", B), ("patched-dense", B), ("patched-dense", B), ("native", B)]
    timed = [r for r in rows if r["pool"] != "meta"]
    assert [(r["mode"], r["round"]) for r in timed[2:8]] == [
        ("native", 0), ("patched-dense", 0), ("kvcached-contiguous", 0),
        ("kvcached-contiguous", 1), ("patched-dense", 1), ("native", 1)]
    assert [r["mode"] for r in rows if r["pool"] == "meta"] == list(offers)
    assert saved == [5, 11, 15] and sorted(e[1] for e in events if e[0] == "close") == sorted(offers)
    # after the last cell every child checks its pools again, and those rows are kept
    last_ask = max(i for i, e in enumerate(events) if e[0] == "ask")
    assert [e for e in events[last_ask + 1:] if e[0] == "finish"] == [("finish", m) for m in offers]
    assert [r["mode"] for r in rows if r.get("after") == "every cell"] == list(offers)


def test_cell_by_cell_closes_every_child_when_one_fails():
    events = []
    offers = {"native": [A, B], "broken": [A, B]}
    with pytest.raises(SystemExit, match="broken"):
        transfer_bench.cell_by_cell_rows(list(offers), 1, lambda m: FakeServingChild(m, offers[m], events))
    assert sorted(e[1] for e in events if e[0] == "close") == ["broken", "native"]


def test_serving_child_replies_with_its_cells_then_one_row_per_request(monkeypatch):
    import io
    cells = {("MHA", "load", "page_first", 64): "cell-a", ("link", "load", "-", 1 << 30): "cell-b"}
    monkeypatch.setattr(transfer_bench, "measure",
                        lambda cell, reps, profiles: {"measured": cell, "reps": reps, "profiles": profiles})
    replies = []
    requests = io.StringIO(json.dumps({"cell": ["link", "load", "-", 1 << 30]}) + "\n"
                           + json.dumps({"cell": ["MHA", "load", "page_first", 64]}) + "\n")
    transfer_bench.serve_requests(cells, 7, [{"mode": "native", "pool": "meta"}], requests, replies.append, 5)
    assert replies == [dict(rows=[{"mode": "native", "pool": "meta"}],
                            cells=[["MHA", "load", "page_first", 64], ["link", "load", "-", 1 << 30]]),
                       {"measured": "cell-b", "reps": 7, "profiles": 5},
                       {"measured": "cell-a", "reps": 7, "profiles": 5}]


def test_layout_cells_time_both_directions_per_batch_and_check_at_4096():
    class KV:
        row_bytes, layers = 10, 3

        def calls(self, host, n, host_runs):
            assert host == "host" and host_runs
            return f"backup{n}", f"load{n}", lambda: n == 4096

    cells, check = transfer_bench.kv_layout_cells(KV(), "host", "page_first", [64, 4096], 1, "native", "MHA+MTP",
                                                  "runs")
    assert [(c[0]["direction"], c[0]["batch"], c[1], c[2], c[3]) for c in cells] == [
        ("backup", 64, 64 * 10 * 4, "backup64", True), ("load", 64, 64 * 10 * 4, "load64", True),
        ("backup", 4096, 4096 * 40, "backup4096", True), ("load", 4096, 4096 * 40, "load4096", True)]
    assert cells[0][0] == dict(mode="native", pool="MHA+MTP", host_layout="page_first", batch=64,
                               host_pages="runs", direction="backup")
    assert check() == dict(mode="native", pool="MHA+MTP", host_layout="page_first", batch=4096,
                           host_pages="runs", byte_exact=True)


def test_reply_channel_keeps_stdout_for_replies_and_sends_other_prints_to_stderr():
    import subprocess
    code = ("import sys; sys.path.insert(0, 'bench'); import transfer_bench as tb; reply = tb.reply_channel(); "
            "print('from sglang'); reply({'rows': []}); print('more'); reply({'batch': 64})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ['{"rows": []}', '{"batch": 64}']
    assert "from sglang" in proc.stderr and "more" in proc.stderr


def test_serving_child_talks_to_its_process_and_shows_its_log_when_it_dies(tmp_path, capsys):
    script = tmp_path / "child.py"
    script.write_text(
        "import json, sys\n"
        "assert sys.argv[1:4] == ['--child', 'native', '--serve'], sys.argv\n"
        "print('setting up', file=sys.stderr)\n"
        "print(json.dumps({'rows': [], 'cells': [['MHA', 'load', 'page_first', 64]]}), flush=True)\n"
        "for line in sys.stdin:\n"
        "    cell = json.loads(line)['cell']\n"
        "    if cell[3] == 0:\n"
        "        sys.exit('no such batch')\n"
        "    print(json.dumps({'batch': cell[3]}), flush=True)\n")
    child = transfer_bench.ServingChild(str(script), "native", None, [])
    assert child.receive()["cells"] == [["MHA", "load", "page_first", 64]]
    assert child.ask(("MHA", "load", "page_first", 64)) == {"batch": 64}
    with pytest.raises(SystemExit, match="native: benchmark child failed"):
        child.ask(("MHA", "load", "page_first", 0))
    assert "no such batch" in capsys.readouterr().err
    child.close()
    ok = transfer_bench.ServingChild(str(script), "native", None, [])
    ok.receive()
    ok.close()
    assert ok.proc.returncode == 0


def test_serving_child_that_closes_its_output_is_reported_as_ended_not_silent(tmp_path, capsys):
    # An end of its replies is a child that ended (or is ending), whatever the reply
    # timeout; only a child that says nothing for that long is taken as hung.
    script = tmp_path / "child.py"
    script.write_text("import os, sys, time\nprint('closing', file=sys.stderr, flush=True)\n"
                      "os.close(1)\ntime.sleep(1)\nsys.exit(3)\n")
    child = transfer_bench.ServingChild(str(script), "native", None, [])
    with pytest.raises(SystemExit, match=r"native: benchmark child failed \(exit 3\)"):
        child.receive(timeout=30)
    assert "closing" in capsys.readouterr().err


def test_a_profiled_cell_takes_the_median_gpu_time_of_as_many_profiled_runs_as_asked(monkeypatch):
    monkeypatch.setattr(transfer_bench, "cuda_times", lambda fn, reps: [0.001] * reps)
    asked = []

    def kernel_profile(fn, runs):
        asked.append(runs)
        return [dict(kernel_us=float(10 * (i + 1)), span_us=1.0) for i in range(runs)]
    monkeypatch.setattr(transfer_bench, "kernel_profile", kernel_profile)
    cell = (dict(mode="native", pool="MHA", direction="load", host_layout="page_first", batch=64), 1000,
            lambda i: None, True)
    assert transfer_bench.measure(cell, 4, 5)["kernel_us"] == 30.0 and asked == [5]
    assert transfer_bench.measure(cell, 4)["kernel_us"] == 20.0 and asked == [5, 3]
    link = (dict(mode="pinned-copy", pool="link", direction="load", host_layout="-", batch=1 << 30), 1 << 30,
            lambda i: None, False)
    assert "kernel_us" not in transfer_bench.measure(link, 4, 5) and asked == [5, 3]


# --- which tree each child imports, and the real reply channel in a child ---------------

def test_only_the_native_child_imports_the_pristine_tree_and_before_the_patched_one(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "patched")
    assert transfer_bench.child_env("native", "pristine")["PYTHONPATH"] == os.pathsep.join(["pristine", "patched"])
    assert transfer_bench.child_env("kvcached-contiguous", "pristine")["PYTHONPATH"] == "patched"
    assert transfer_bench.child_env("native", None)["PYTHONPATH"] == "patched"


def test_serving_child_runs_in_its_variants_environment(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import json, os\n"
                      "print(json.dumps({'rows': [{'path': os.environ.get('PYTHONPATH')}], 'cells': []}), flush=True)\n")
    child = transfer_bench.ServingChild(str(script), "native", "/pristine", [])
    assert child.receive()["rows"][0]["path"].split(os.pathsep)[0] == "/pristine"
    child.close()


def test_a_serving_child_that_falls_silent_is_stopped_and_its_log_shown(tmp_path, capsys):
    script = tmp_path / "child.py"
    script.write_text("import sys, time\nprint('building pools', file=sys.stderr, flush=True)\ntime.sleep(60)\n")
    child = transfer_bench.ServingChild(str(script), "kvcached-per-layer", None, [])
    started = time.monotonic()   # its first words logged, however slowly the machine starts it
    while not os.fstat(child.log.fileno()).st_size and time.monotonic() - started < 30:
        time.sleep(0.05)
    with pytest.raises(SystemExit, match="kvcached-per-layer: benchmark child sent nothing in 1 s"):
        child.receive(timeout=1)
    assert child.proc.returncode is not None and "building pools" in capsys.readouterr().err
    child.close()


def test_a_reply_reaches_the_parent_while_the_child_still_runs():
    import select
    import subprocess
    code = ("import sys; sys.path.insert(0, 'bench'); import transfer_bench as tb; "
            "reply = tb.reply_channel(); tb.measure = lambda cell, reps, profiles: {'cell': cell}; "
            "tb.serve_requests({('MHA', 'load', 'page_first', 64): 'a'}, 1, [], sys.stdin, reply)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "no hello while the child waits for requests"
        assert json.loads(proc.stdout.readline())["cells"] == [["MHA", "load", "page_first", 64]]
        proc.stdin.write(json.dumps({"cell": ["MHA", "load", "page_first", 64]}) + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready and json.loads(proc.stdout.readline()) == {"cell": "a"}
    finally:
        proc.stdin.close()
        proc.wait(timeout=20)


def test_the_byte_check_is_the_4096_token_batchs_even_when_larger_batches_follow():
    class KV:
        row_bytes, layers = 10, 3

        def calls(self, host, n, host_runs):
            return f"backup{n}", f"load{n}", lambda: n == 4096

    _, check = transfer_bench.kv_layout_cells(KV(), "host", "page_first", [64, 4096, 16384], 0, "native", "MHA",
                                              "random")
    assert check() == dict(mode="native", pool="MHA", host_layout="page_first", batch=4096, host_pages="random",
                           byte_exact=True)


# --- serve(): cells of every layout, named apart; checks at setup and at the end ---------

class FakeKVBench:
    row_bytes, layers = 10, 2
    checked = []

    def __init__(self, kind, gen, max_tokens, drafts=0):
        self.kind = kind

    def host_pool(self, layout):
        return layout

    def calls(self, host, n, host_runs):
        return (lambda i: None), (lambda i: None), (lambda: FakeKVBench.checked.append((self.kind, host)) or True)


@pytest.fixture
def fake_serving(monkeypatch):
    monkeypatch.setattr(transfer_bench, "import_sglang", lambda mode: None)
    monkeypatch.setattr(transfer_bench, "meta_row", lambda mode, sglang: dict(mode=mode, pool="meta"))
    monkeypatch.setattr(transfer_bench, "KVBench", FakeKVBench)
    monkeypatch.setattr(FakeKVBench, "checked", [])
    monkeypatch.setattr(transfer_bench, "TOKENS", [64, 4096])
    link = dict(mode="pinned-copy", pool="link", host_layout="-", batch=1 << 30)
    monkeypatch.setattr(transfer_bench, "link_cells", lambda: [(dict(link, direction="load"), 1 << 30, None, False)])
    monkeypatch.setattr(transfer_bench, "measure", lambda cell, reps, profiles: dict(cell[0], profiles=profiles))


def test_serve_offers_every_layouts_cells_and_checks_every_pool_at_setup_and_at_the_end(fake_serving):
    replies = []
    requests = [json.dumps({"cell": ["MHA", "load", "layer_first", 4096]}), json.dumps({"finish": True}),
                json.dumps({"cell": ["MHA", "load", "page_first", 64]})]   # after finish: not served
    transfer_bench.serve("native", 2, ["link", "mha"], "runs", ("layer_first", "page_first"), requests,
                         replies.append, 5)
    hello = replies[0]
    assert len(hello["cells"]) == 1 + 2 * 2 * 2 and len({tuple(c) for c in hello["cells"]}) == len(hello["cells"])
    assert [(r["host_layout"], r["byte_exact"]) for r in hello["rows"] if "byte_exact" in r] == [
        ("layer_first", True), ("page_first", True)]
    assert replies[1] == dict(mode="native", pool="MHA", host_layout="layer_first", batch=4096, host_pages="runs",
                              direction="load", profiles=5)
    assert [(r["host_layout"], r["byte_exact"]) for r in replies[2]["rows"]] == [
        ("layer_first", True), ("page_first", True)]
    assert len(replies) == 3 and FakeKVBench.checked == [("mha", "layer_first"), ("mha", "page_first")] * 2


def test_only_the_native_serving_child_offers_the_link(fake_serving):
    replies = []
    transfer_bench.serve("kvcached-contiguous", 2, ["link", "mha"], "runs", ("page_first",), [], replies.append)
    assert replies[0]["cells"] and all(c[0] != "link" for c in replies[0]["cells"])


def test_whole_run_children_profile_each_kv_cell_as_often_as_asked(fake_serving, monkeypatch):
    monkeypatch.setattr(FakeKVBench, "release", lambda self: None, raising=False)
    monkeypatch.setattr(FakeKVBench, "host_pool", lambda self, layout: SimpleNamespace(destroy=lambda: None))
    rows = transfer_bench.child("native", 2, ["mha"], "random", ("page_first",), profiles=9)
    timed = [r for r in rows if "direction" in r]
    assert len(timed) == 4 and {r["profiles"] for r in timed} == {9}


# --- main(): what it hands its children ---------------------------------------------------

def run_main(monkeypatch, tmp_path, *argv, cells=()):
    """transfer_bench.main() with its children and the GPU faked (serving children offer
    `cells`); returns (mode, args) per child started."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(transfer_bench, "table", lambda rows: "")
    seen = []

    def run_child(script, mode, native, args):
        seen.append((mode, args))
        return [dict(mode=mode, pool="meta")]

    class Child:
        def __init__(self, script, mode, native, args):
            self.mode = mode
            seen.append((mode, args))

        def receive(self):
            return dict(rows=[], cells=[list(c) for c in cells])

        def ask(self, cell):
            return dict(mode=self.mode, pool=cell[0], direction=cell[1], host_layout=cell[2], batch=cell[3])

        def finish(self):
            return []

        def close(self):
            pass
    monkeypatch.setattr(transfer_bench, "run_child", run_child)
    monkeypatch.setattr(transfer_bench, "ServingChild", Child)
    monkeypatch.setattr(sys, "argv", ["transfer_bench.py", "--out", str(tmp_path / "r.json"), *argv])
    transfer_bench.main()
    return seen


def test_main_hands_profiles_to_every_child(monkeypatch, tmp_path):
    seen = run_main(monkeypatch, tmp_path, "--parts", "mha", "--modes", "native,patched-dense", "--profiles", "7")
    assert [m for m, _ in seen] == ["native", "patched-dense"]
    for _, args in seen:
        assert args[args.index("--profiles") + 1] == "7"


def test_process_sets_start_fresh_children_per_set_and_number_the_rounds_on(monkeypatch, tmp_path):
    seen = run_main(monkeypatch, tmp_path, "--parts", "mha", "--modes", "native,kvcached-per-layer",
                    "--cell-by-cell", "--rounds", "2", "--process-sets", "3", cells=[A])
    assert [m for m, _ in seen] == ["native", "kvcached-per-layer"] * 3
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert sorted((r["mode"], r["round"]) for r in rows) == sorted(
        (m, r) for m in ("native", "kvcached-per-layer") for r in range(6))


@pytest.mark.parametrize("argv", [("--profiles", "0"), ("--process-sets", "2"), ("--cell-by-cell", "--parts", "mha,mamba")])
def test_main_refuses_what_it_cannot_run(monkeypatch, tmp_path, argv):
    with pytest.raises(SystemExit) as exc:
        run_main(monkeypatch, tmp_path, *argv)
    assert exc.value.code == 2 and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_kv_model_row_bytes_are_a_tokens_bytes_in_one_layer_of_that_models_pool(kind):
    from tests.support.kvcached_views import mha_pool, mla_pool
    model, row_bytes = transfer_bench.kv_model(kind)
    if kind == "mha":
        pool = mha_pool("native", size=64, page_size=64, layers=1, heads=model.kv_heads, head_dim=model.head_dim)
        views = [pool.k_buffer[0], pool.v_buffer[0]]
    else:
        pool = mla_pool("native", size=64, page_size=64, layers=1, kv_lora_rank=model.kv_lora_rank,
                        qk_rope_head_dim=model.qk_rope_head_dim)
        views = [pool.kv_buffer[0]]
    assert row_bytes == sum(v[0].numel() * v.element_size() for v in views)


def test_a_pool_hands_out_more_pages_than_the_largest_batch_takes_and_keeps_64_back():
    n_pages, size = transfer_bench.pool_pages(4096)
    assert n_pages * transfer_bench.PAGE > 4096 and size // transfer_bench.PAGE - n_pages == 64


def sglang_tree(python_dir) -> SimpleNamespace:
    """What meta_row reads of an imported sglang module: where it lives."""
    return SimpleNamespace(__file__=str(Path(python_dir) / "sglang" / "__init__.py"))


def test_each_variant_refuses_a_tree_without_the_series_state_it_claims():
    # A native variant on a patched tree compares the series with itself, and a patched
    # variant on a pristine tree times SGLang as shipped: the child stops in both cases.
    if not os.environ.get("PRISTINE_SGLANG"):
        pytest.skip("set by `make test`: PRISTINE_SGLANG, the pristine tree's python/ folder")
    import sglang

    pristine, patched = sglang_tree(os.environ["PRISTINE_SGLANG"]), sglang_tree(Path(sglang.__file__).parents[1])
    assert transfer_bench.meta_row("native", pristine)["series_applied"].endswith(": series pristine")
    assert transfer_bench.meta_row("kvcached-contiguous", patched)["series_applied"].endswith(": series applied")
    with pytest.raises(SystemExit, match=r"native: needs an SGLang tree with the series pristine \(pass a "
                                         r"pristine copy's python/ folder as --native-sglang\).*series applied"):
        transfer_bench.meta_row("native", patched)
    with pytest.raises(SystemExit, match=r"patched-dense: needs an SGLang tree with the series applied; "
                                         r"scripts/status says: .*series pristine"):
        transfer_bench.meta_row("patched-dense", pristine)


def test_a_native_tree_edited_outside_the_series_is_refused(tmp_path):
    # None of the series in it, so scripts/status calls it pristine, and lists the edit.
    if not os.environ.get("PRISTINE_SGLANG"):
        pytest.skip("set by `make test`: PRISTINE_SGLANG, the pristine tree's python/ folder")
    import shutil

    shutil.copytree(Path(os.environ["PRISTINE_SGLANG"]) / "sglang", tmp_path / "pristine" / "sglang", symlinks=True)
    with open(tmp_path / "pristine" / "sglang" / "srt" / "mem_cache" / "pool_host" / "mha.py", "a") as handle:
        handle.write("\nEDITED = True\n")
    with pytest.raises(SystemExit, match=r"native: needs .*: series pristine; local edits .*"
                                         r"sglang/srt/mem_cache/pool_host/mha\.py"):
        transfer_bench.meta_row("native", sglang_tree(tmp_path / "pristine"))


def saved_run(path, native_state, rows, patched_state="applied", **setup):
    # the native tree's path holds the word "pristine" whatever its state, as on a GPU machine
    meta = [dict(mode="native", pool="meta", sglang="/tmp/pristine/sglang",
                 series_applied=f"SGLang 0.5.20 at /tmp/pristine/sglang: series {native_state}")]
    meta += [dict(mode=mode, pool="meta", sglang="/site/sglang", series_applied=f"SGLang at /site: series {patched_state}")
             for mode in ("patched-dense", "kvcached-contiguous", "kvcached-per-layer")]
    setup = dict(gpu="H200", torch="2.11", page_size=64, host_pages="runs", cell_by_cell=True) | setup
    data = {"meta": {k: v for k, v in setup.items() if v is not None}, "rows": meta + rows}  # None: not saved
    path.write_text(json.dumps(data))
    return str(path)


def test_table_pairs_rounds_with_natives_and_tests_cells_over_sets_of_processes(tmp_path):
    # Three runs, each two sets of fresh children of two rounds (--rounds 2 --process-sets
    # 2): rounds 0-1 are the first set, 2-3 the second, so six sets a cell in all.
    def timed(mode, batch, sets):   # sets: each set's two rounds' GPU times
        return [dict(row(mode, 5.0, kernel_us=t, batch=batch), round=2 * k + i)
                for k, pair in enumerate(sets) for i, t in enumerate(pair)]
    cell = lambda mode, batch: (mode, "MLA", "load", "layer_first", batch)

    def run(name, native, contig_64, per_layer_256, dense_4096):
        rows = [r for batch in (64, 256, 1024, 4096, 65536) for r in timed("native", batch, [[native] * 2] * 2)]
        rows += timed("kvcached-contiguous", 64, [[contig_64] * 2] * 2)     # slower in every set
        rows += timed("kvcached-per-layer", 256, per_layer_256)
        rows += timed("kvcached-contiguous", 1024, [[native] * 2] * 2)      # ties: not slower
        rows += timed("patched-dense", 4096, dense_4096)
        rows += timed("kvcached-per-layer", 65536, [[native * 1.01, native * 1.02]] * 2)   # slower in every set
        return saved_run(tmp_path / f"{name}.json", "pristine", rows, rounds=2)
    runs = [run("a", 100, 100.5, [[99, 99], [99, 99]], [[100.5] * 2] * 2),
            # native takes twice as long in this run: its variants pair with its own native
            run("b", 200, 201, [[198, 198], [202, 202]], [[201] * 2] * 2),
            # dense is slower in 10 of 12 rounds but in 4 of 6 sets: a slow set is one trial
            run("c", 100, 100.5, [[99, 99], [300, 99]], [[100.5, 90], [100.5, 90]])]
    paired = transfer_bench.paired_gpu_ratios(transfer_bench.saved_rows(runs))
    assert set(paired) == {cell("kvcached-contiguous", 64), cell("kvcached-per-layer", 256),
                           cell("kvcached-contiguous", 1024), cell("patched-dense", 4096),
                           cell("kvcached-per-layer", 65536)}
    assert [len(sets) for sets in paired.values()] == [6] * 5
    assert sorted(r for sets in paired[cell("kvcached-contiguous", 64)].values() for r in sets) == \
        [100 / 100.5] * 8 + [200 / 201] * 4
    lines = transfer_bench.table(transfer_bench.saved_rows(runs)).splitlines()
    # per-layer 256's ratios are 9 x 100/99, 2 x 100/101 and 1/3: its median 100/99, its
    # mean the lowest of all; the lowest median is per-layer 65536's
    low = statistics.median([1 / 1.01, 1 / 1.02] * 6)
    assert f"lowest round-paired GPU-time ratio to native (median): {low:.4f} (kvcached-per-layer, " \
           "MLA load layer_first 65536)" in lines
    # two cells slower in 6 of 6 sets, in the order of their medians; four cells with six
    # untied sets and one of ties: chance alone names 4 / 64 of a cell
    assert ("slower than native in more sets of processes than chance allows (each set's median, sign test, "
            f"p < 0.05): kvcached-per-layer, MLA load layer_first 65536: 6 of 6 sets, median {low:.4f}; "
            f"kvcached-contiguous, MLA load layer_first 64: 6 of 6 sets, median {100 / 100.5:.4f} "
            "(of 5 cells; chance alone would name 0.1)") in lines
    # one run alone: two sets a cell, too few for the test
    assert lines_of(transfer_bench.table(transfer_bench.saved_rows(runs[:1])), "slower than native")[0].endswith(
        "p < 0.05): none (the test needs 5 sets of processes a cell; these runs have 2)")
    # five sets, a round each (a whole run starts fresh children every round): enough
    whole = saved_run(tmp_path / "w.json", "pristine", timed("native", 64, [[100]] * 5)
                      + timed("kvcached-contiguous", 64, [[101]] * 5), cell_by_cell=False, rounds=5)
    assert lines_of(transfer_bench.table(transfer_bench.saved_rows([whole])), "slower than native")[0].endswith(
        f"median {100 / 101:.4f} (of 1 cells; chance alone would name 0.0)")
    # a one-round run has nothing to pair within a cell
    assert "round-paired" not in transfer_bench.table(timed("native", 64, [[100]]) + timed("kvcached-contiguous", 64, [[101]]))
    # a run given twice would count its rounds twice
    with pytest.raises(SystemExit, match=r"a\.json: given twice"):
        transfer_bench.saved_rows([runs[0], runs[1], str(tmp_path / "." / "a.json")])
    assert [transfer_bench.sign_test(k, n - k) for k, n in ((5, 5), (0, 7), (12, 15))] == [1 / 32, 1.0, 576 / 2 ** 15]


def lines_of(text, start):
    return [line for line in text.splitlines() if line.startswith(start)]


def test_table_pools_saved_runs_and_refuses_one_whose_native_ran_the_series(tmp_path, capsys):
    # Two runs of one cell: the pooled table takes the median GPU time over all four rounds
    # (native 100, 104, 106, 110 -> 105; contig 100, 100, 104, 130 -> 102): 105 / 102.
    def rounds(mode, times):
        return [dict(row(mode, 5.0, kernel_us=t), round=i) for i, t in enumerate(times)]
    first = saved_run(tmp_path / "a.json", "pristine", rounds("native", [100, 110]) +
                      rounds("kvcached-contiguous", [100, 130]) + rounds("kvcached-per-layer", [100, 100]))
    second = saved_run(tmp_path / "b.json", "pristine", rounds("native", [104, 106]) +
                       rounds("kvcached-contiguous", [100, 104]))
    pooled = transfer_bench.table(transfer_bench.saved_rows([first, second]))
    line = next(l for l in pooled.splitlines() if l.startswith("| MLA"))
    assert [c.strip() for c in line.strip("|").split("|")][9] == "1.00 (1.03)"
    assert f"lowest GPU-time ratio to native: {105 / 102:.4f} (kvcached-contiguous, MLA load layer_first 64)" in pooled
    assert "over its 2-4 rounds" in pooled and sum(l.startswith("tree: native") for l in pooled.splitlines()) == 1
    stale = saved_run(tmp_path / "c.json", "applied", rounds("native", [100]))
    with pytest.raises(SystemExit, match=r"c\.json: its native variant's tree is not on record as pristine "
                                         r"\(SGLang 0\.5\.20 at /tmp/pristine/sglang: series applied\)"):
        transfer_bench.saved_rows([first, stale])
    for key, value in (("gpu", "H100"), ("torch", "2.9"), ("page_size", 32),
                       ("host_pages", "random"), ("cell_by_cell", False)):
        other = saved_run(tmp_path / "d.json", "pristine", rounds("native", [100]), **{key: value})
        with pytest.raises(SystemExit, match=rf"a\.json and .*d\.json were measured differently \({key} "):
            transfer_bench.saved_rows([first, other])
    # --cell-by-cell's first name; repetitions and profiled runs only say how precisely
    renamed = saved_run(tmp_path / "e.json", "pristine", rounds("native", [100]), cell_by_cell=None, interleave=True,
                        reps=20, profiles=3)
    assert len(transfer_bench.saved_rows([first, renamed])) == len(transfer_bench.saved_rows([first])) + 5   # 4 meta rows, 1 timed
    pristine_patched = saved_run(tmp_path / "f.json", "pristine", rounds("kvcached-per-layer", [100]),
                                 patched_state="pristine")
    with pytest.raises(SystemExit, match=r"f\.json: its kvcached-per-layer variant's tree is not on record as applied"):
        transfer_bench.saved_rows([pristine_patched])
    unrecorded = tmp_path / "g.json"
    unrecorded.write_text(json.dumps({"meta": dict(gpu="H200"), "rows": rounds("patched-dense", [100])}))
    with pytest.raises(SystemExit, match=r"g\.json: its patched-dense variant's tree is not on record as applied "
                                         r"\(no record\)"):
        transfer_bench.saved_rows([str(unrecorded)])
    unrecorded.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match=r"g\.json: not a transfer_bench.py --out file"):
        transfer_bench.saved_rows([str(unrecorded)])
    sys_argv = sys.argv
    try:
        sys.argv = ["transfer_bench.py", "--table", first, second]
        transfer_bench.main()
    finally:
        sys.argv = sys_argv
    assert capsys.readouterr().out.strip() == pooled


# --- --tokens: the KV parts' batches, chosen per run ----------------------------------------

@pytest.mark.parametrize("text,tokens", [("64", [64]), ("64,16384", [64, 16384])])
def test_tokens_are_read_as_batches_of_whole_pages(text, tokens):
    assert transfer_bench.token_list(text) == tokens


@pytest.mark.parametrize("text", ["100", "0", "64,-64", "64,a", ""])
def test_tokens_that_are_not_whole_pages_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        transfer_bench.token_list(text)


def test_serve_times_only_the_batches_asked_for_and_checks_the_largest_without_4096(fake_serving):
    replies = []
    transfer_bench.serve("native", 2, ["mha"], "runs", ("page_first",), [], replies.append, 3, [64, 128])
    assert sorted({c[3] for c in replies[0]["cells"]}) == [64, 128]
    assert [(r["batch"], r["byte_exact"]) for r in replies[0]["rows"] if "byte_exact" in r] == [(128, True)]


def test_whole_run_children_time_only_the_batches_asked_for(fake_serving, monkeypatch):
    monkeypatch.setattr(FakeKVBench, "release", lambda self: None, raising=False)
    monkeypatch.setattr(FakeKVBench, "host_pool", lambda self, layout: SimpleNamespace(destroy=lambda: None))
    rows = transfer_bench.child("native", 2, ["mtp-mha"], "random", ("page_first",), tokens=[128])
    assert {r["batch"] for r in rows if "direction" in r} == {128}


def test_main_hands_the_batches_to_every_child_and_records_them(monkeypatch, tmp_path):
    seen = run_main(monkeypatch, tmp_path, "--parts", "mha", "--modes", "native,patched-dense", "--tokens", "64,16384")
    for _, args in seen:
        assert args[args.index("--tokens") + 1] == "64,16384"
    assert json.loads((tmp_path / "r.json").read_text())["meta"]["tokens"] == [64, 16384]
    assert all("--tokens" not in args for _, args in run_main(monkeypatch, tmp_path, "--parts", "mha"))


@pytest.mark.project_files  # README.md is not in the image
def test_readme_performance_table_is_the_committed_rounds():
    """README's performance table: kvcached-contiguous GB/s (native's in brackets) of the
    committed three-round run, medians as merge_rounds takes them, to one decimal."""
    root = Path(__file__).resolve().parents[2]
    run = json.loads((root / "bench" / "results" / "2026-12-01-h200-rounds" / "results.json").read_text())
    cells = {(r["pool"], r["direction"], r["batch"], r["mode"]): r["GBps"]
             for r in transfer_bench.merge_rounds(run["rows"]) if r.get("host_layout") == "page_first" and "GBps" in r}
    links = {r["direction"]: r["GBps"] for r in transfer_bench.merge_rounds(run["rows"]) if r.get("pool") == "link"}
    readme = (root / "README.md").read_text()
    assert f"moves {links['backup']:.1f} (backup) and {links['load']:.1f} GB/s (load)" in readme
    columns = [("MHA", "backup"), ("MHA", "load"), ("MLA", "backup"), ("MLA", "load")]
    for tokens in (64, 1024, 16384, 65536):
        parts = []
        for i, (pool, direction) in enumerate(columns):
            elastic = cells[(pool, direction, tokens, "kvcached-contiguous")]
            native = cells[(pool, direction, tokens, "native")]
            parts.append(f"{elastic:.1f} ({'native ' if tokens == 64 and i == 0 else ''}{native:.1f})")
        assert f"| {tokens:,} | " + " | ".join(parts) + " |" in readme, tokens
