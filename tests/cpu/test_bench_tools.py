"""bench/transfer_bench.py without a GPU: the numbers its tables print, how it schedules its
children, and the one-line errors its CLI (and bench/plot.py's) gives for input it cannot run."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import plot  # noqa: E402
import transfer_bench  # noqa: E402

LINK = ("link", "backup", "-", 1 << 30)
A, B = ("MHA", "load", "page_first", 64), ("MLA", "load", "page_first", 64)


def row(mode, gbps, kernel_us=None, batch=64):
    r = dict(mode=mode, pool="MLA", direction="load", host_layout="layer_first", batch=batch, GBps=gbps)
    return r if kernel_us is None else dict(r, kernel_us=kernel_us)


def cells_of(text, start="| MLA"):
    return [c.strip() for c in next(line for line in text.splitlines() if line.startswith(start)).strip("|").split("|")]


def cli(*argv):
    return subprocess.run([sys.executable, "bench/transfer_bench.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


# --- the table: ratios to native, medians over rounds ----------------------------------------

def test_table_gives_event_and_gpu_time_ratios_to_native():
    rows = [dict(mode="pinned-copy", pool="link", direction="load", host_layout="-", batch=1 << 30, GBps=50.0),
            row("native", 5.0, kernel_us=110.0), row("kvcached-contiguous", 4.0, kernel_us=100.0),
            row("patched-dense", 6.0)]
    cells = cells_of(transfer_bench.table(rows))
    # dense/native: events only (no GPU time); contig/native: 4/5 by events, 110/100 by GPU time
    assert cells[8:11] == ["1.20", "0.80 (1.10)", "-"]
    # each variant's share of the 50 GB/s link: native, dense, contig, per-layer (not run)
    assert cells[11:15] == ["0.10", "0.12", "0.08", "-"]


def test_rounds_alternate_which_variant_runs_first():
    assert transfer_bench.round_order(["native", "dense", "contig"], 3) == [
        (0, "native"), (0, "dense"), (0, "contig"), (1, "contig"), (1, "dense"), (1, "native"),
        (2, "native"), (2, "dense"), (2, "contig")]


def test_table_of_several_rounds_takes_each_cells_median_and_keeps_failures():
    link = dict(mode="pinned-copy", pool="link", direction="load", host_layout="-", batch=1 << 30)
    check = dict(mode="kvcached-contiguous", pool="MLA", host_layout="layer_first", batch=4096)
    rounds = [[dict(link, GBps=50.0), row("native", 5.0, 110.0), row("kvcached-contiguous", 4.0, 100.0),
               dict(check, byte_exact=True)],
              [dict(link, GBps=40.0), row("native", 9.0, 90.0), row("kvcached-contiguous", 6.0, 120.0),
               dict(check, byte_exact=False)],
              [dict(link, GBps=45.0), row("native", 6.0, 100.0), row("kvcached-contiguous", 5.0, 80.0),
               dict(check, byte_exact=True), dict(mode="kvcached-per-layer", pool="MLA", error="boom")]]
    text = transfer_bench.table([dict(r, round=i) for i, rs in enumerate(rounds) for r in rs])
    # medians: native 6.0 GB/s over 100 us, contig 5.0 over 100 us, link 45
    cells = cells_of(text)
    assert cells[4:7] == ["6.00", "-", "5.00"] and cells[9] == "0.83 (1.00)" and cells[11] == "0.13"
    # a check that failed in one round fails; one round's error is still reported
    assert "byte-exact load-back checks: 0 of 1 pass" in text and "not measured: kvcached-per-layer MLA: boom" in text


@pytest.mark.parametrize("runs", [False, True])
def test_token_sets_are_whole_pages_in_range_random_or_one_run(runs):
    gen, page = torch.Generator().manual_seed(0), transfer_bench.PAGE
    starts = set()
    for tokens in transfer_bench.token_sets(gen, total_pages=40, n_tokens=8 * page, count=20, runs=runs):
        pages = (tokens[::page] // page).tolist()
        assert tokens.tolist() == [p * page + t for p in pages for t in range(page)]
        assert len(set(pages)) == 8 and 1 <= min(pages) and max(pages) < 40   # page 0 skipped
        assert (pages == list(range(pages[0], pages[0] + 8))) == runs
        starts.add(pages[0])
    assert len(starts) > 5


# --- children: which tree each imports, cell by cell, the reply channel ----------------------

def test_only_the_native_child_imports_the_pristine_tree_and_before_the_patched_one(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "patched")
    assert transfer_bench.child_env("native", "pristine")["PYTHONPATH"] == os.pathsep.join(["pristine", "patched"])
    assert transfer_bench.child_env("kvcached-contiguous", "pristine")["PYTHONPATH"] == "patched"
    assert transfer_bench.child_env("native", None)["PYTHONPATH"] == "patched"


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
        if self.mode == "broken" and cell == B:
            raise SystemExit("broken: benchmark child failed")
        return dict(mode=self.mode, pool=cell[0], direction=cell[1], host_layout=cell[2], batch=cell[3])

    def finish(self):
        self.events.append(("finish", self.mode))
        return [dict(mode=self.mode, pool="MHA", byte_exact=True, after="every cell")]

    def close(self):
        self.events.append(("close", self.mode))


def test_cell_by_cell_times_each_cell_in_all_rounds_and_variants_before_the_next():
    events = []
    offers = {"native": [LINK, A, B], "patched-dense": [A, B], "kvcached-contiguous": [A]}
    rows = transfer_bench.cell_by_cell_rows(list(offers), 2, lambda m: FakeServingChild(m, offers[m], events))
    asks = [(e[1], e[2]) for e in events if e[0] == "ask"]
    assert asks == [("native", LINK), ("native", LINK),
                    ("native", A), ("patched-dense", A), ("kvcached-contiguous", A),
                    ("kvcached-contiguous", A), ("patched-dense", A), ("native", A),
                    ("native", B), ("patched-dense", B), ("patched-dense", B), ("native", B)]
    # after the last cell every child checks its pools again, and every child is closed
    assert [r["mode"] for r in rows if r.get("after") == "every cell"] == list(offers)
    assert sorted(e[1] for e in events if e[0] == "close") == sorted(offers)


def test_cell_by_cell_closes_every_child_when_one_fails():
    events = []
    with pytest.raises(SystemExit, match="broken"):
        transfer_bench.cell_by_cell_rows(["native", "broken"], 1, lambda m: FakeServingChild(m, [A, B], events))
    assert sorted(e[1] for e in events if e[0] == "close") == ["broken", "native"]


def test_a_serving_child_that_dies_is_reported_with_its_log(tmp_path, capsys):
    script = tmp_path / "child.py"
    script.write_text("import json, sys\nprint('setting up', file=sys.stderr)\n"
                      "print(json.dumps({'rows': [], 'cells': []}), flush=True)\n"
                      "for line in sys.stdin:\n    sys.exit('no such batch')\n")
    child = transfer_bench.ServingChild(str(script), "native", None, [])
    child.receive()
    with pytest.raises(SystemExit, match="native: benchmark child failed"):
        child.ask(A)
    assert "no such batch" in capsys.readouterr().err
    child.close()


def sglang_tree(python_dir) -> SimpleNamespace:
    """What meta_row reads of an imported sglang module: where it lives."""
    return SimpleNamespace(__file__=str(Path(python_dir) / "sglang" / "__init__.py"))


def test_each_variant_refuses_a_tree_without_the_series_state_it_claims(tmp_path):
    # A native variant on a patched (or edited) tree compares the series with itself, and a
    # patched variant on a pristine tree times SGLang as shipped: the child stops.
    if not os.environ.get("PRISTINE_SGLANG"):
        pytest.skip("set by `make test`: PRISTINE_SGLANG, the pristine tree's python/ folder")
    import shutil

    import sglang
    pristine, patched = sglang_tree(os.environ["PRISTINE_SGLANG"]), sglang_tree(Path(sglang.__file__).parents[1])
    assert transfer_bench.meta_row("native", pristine)["series_applied"].endswith(": series pristine")
    with pytest.raises(SystemExit, match=r"native: needs an SGLang tree with the series pristine"):
        transfer_bench.meta_row("native", patched)
    with pytest.raises(SystemExit, match=r"patched-dense: needs an SGLang tree with the series applied"):
        transfer_bench.meta_row("patched-dense", pristine)
    shutil.copytree(Path(os.environ["PRISTINE_SGLANG"]) / "sglang", tmp_path / "sglang", symlinks=True)
    with open(tmp_path / "sglang" / "srt" / "mem_cache" / "pool_host" / "mha.py", "a") as handle:
        handle.write("\nEDITED = True\n")
    with pytest.raises(SystemExit, match=r"native: needs .*local edits .*sglang/srt/mem_cache/pool_host/mha\.py"):
        transfer_bench.meta_row("native", sglang_tree(tmp_path))


# --- main(): what it hands its children, what it refuses ---------------------------------------

def run_main(monkeypatch, tmp_path, *argv, cells=()):
    """transfer_bench.main() with its children and the GPU faked (serving children offer
    `cells`); returns (mode, args) per child started."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake GPU")
    monkeypatch.setattr(transfer_bench, "table", lambda rows: "")
    seen = []

    def run_child(script, mode, native, args):
        seen.append((mode, args))
        return [dict(mode=mode, pool="meta")]

    class Child(FakeServingChild):
        def __init__(self, script, mode, native, args):
            super().__init__(mode, cells, [])
            seen.append((mode, args))
    monkeypatch.setattr(transfer_bench, "run_child", run_child)
    monkeypatch.setattr(transfer_bench, "ServingChild", Child)
    monkeypatch.setattr(sys, "argv", ["transfer_bench.py", "--out", str(tmp_path / "r.json"), *argv])
    transfer_bench.main()
    return seen


def test_main_hands_profiles_and_batches_to_every_child_and_records_them(monkeypatch, tmp_path):
    seen = run_main(monkeypatch, tmp_path, "--parts", "mha", "--modes", "native,patched-dense", "--profiles", "7",
                    "--tokens", "64,16384")
    assert [m for m, _ in seen] == ["native", "patched-dense"]
    for _, args in seen:
        assert args[args.index("--profiles") + 1] == "7" and args[args.index("--tokens") + 1] == "64,16384"
    assert json.loads((tmp_path / "r.json").read_text())["meta"]["tokens"] == [64, 16384]


def test_process_sets_start_fresh_children_per_set_and_number_the_rounds_on(monkeypatch, tmp_path):
    seen = run_main(monkeypatch, tmp_path, "--parts", "mha", "--modes", "native,kvcached-per-layer",
                    "--cell-by-cell", "--rounds", "2", "--process-sets", "3", cells=[A])
    assert [m for m, _ in seen] == ["native", "kvcached-per-layer"] * 3
    rows = [r for r in json.loads((tmp_path / "r.json").read_text())["rows"] if r["pool"] != "meta"]
    assert sorted((r["mode"], r["round"]) for r in rows if "round" in r) == sorted(
        (m, r) for m in ("native", "kvcached-per-layer") for r in range(6))


@pytest.mark.parametrize("argv,error", [
    (("--parts", "mha,bogus"), "--parts: unknown bogus"),
    (("--host-layouts", "sideways"), "--host-layouts: any of"),
    (("--tokens", "100"), "100: not a positive multiple of the page"),
    (("--tokens", "64,a"), "comma-separated whole numbers"),
    (("--profiles", "0"), "at least 1"),
    (("--reps", "0"), "--reps, --rounds, --profiles, --process-sets: at least 1"),
    (("--modes", "native,foo"), "--modes: unknown foo (any of native,"),
    (("--process-sets", "2"), "--process-sets: with --cell-by-cell"),
    (("--cell-by-cell", "--parts", "mha,mamba"), "--cell-by-cell: KV parts and link only"),
    (("--table", "no-such-run.json"), "no-such-run.json: cannot read it"),
])
def test_input_it_cannot_run_is_refused_in_one_line_before_any_gpu_work(argv, error):
    proc = cli(*argv)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert error in proc.stderr.strip().splitlines()[-1]


def test_measuring_without_a_cuda_gpu_is_refused_in_one_line_before_any_child(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(transfer_bench, "run_child", lambda *a: pytest.fail("a child ran"))
    monkeypatch.setattr(sys, "argv", ["transfer_bench.py", "--parts", "mha", "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit) as exc:
        transfer_bench.main()
    assert exc.value.code == 2 and "measuring needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


# --- --table: saved runs pooled, round-paired, tested over sets of processes -------------------

def saved_run(path, native_state, rows, patched_state="applied", **setup):
    meta = [dict(mode="native", pool="meta", sglang="/tmp/pristine/sglang",
                 series_applied=f"SGLang 0.5.20 at /tmp/pristine/sglang: series {native_state}")]
    meta += [dict(mode=mode, pool="meta", sglang="/site/sglang", series_applied=f"SGLang at /site: series {patched_state}")
             for mode in ("patched-dense", "kvcached-contiguous", "kvcached-per-layer")]
    setup = dict(gpu="H200", torch="2.11", page_size=64, host_pages="runs", cell_by_cell=True) | setup
    path.write_text(json.dumps({"meta": setup, "rows": meta + rows}))
    return str(path)


def rounds(mode, times, batch=64):
    return [dict(row(mode, 5.0, kernel_us=t, batch=batch), round=i) for i, t in enumerate(times)]


def test_table_pools_saved_runs_and_refuses_runs_it_cannot_pool(tmp_path):
    # native 100, 104, 106, 110 -> 105; contig 100, 100, 104, 130 -> 102: 105 / 102
    first = saved_run(tmp_path / "a.json", "pristine", rounds("native", [100, 110]) +
                      rounds("kvcached-contiguous", [100, 130]))
    second = saved_run(tmp_path / "b.json", "pristine", rounds("native", [104, 106]) +
                       rounds("kvcached-contiguous", [100, 104]))
    proc = cli("--table", first, second)
    assert proc.returncode == 0 and cells_of(proc.stdout)[9] == "1.00 (1.03)"
    assert f"lowest GPU-time ratio to native: {105 / 102:.4f} (kvcached-contiguous, MLA load layer_first 64)" \
        in proc.stdout
    stale = saved_run(tmp_path / "c.json", "applied", rounds("native", [100]))
    with pytest.raises(SystemExit, match=r"c\.json: its native variant's tree is not on record as pristine"):
        transfer_bench.saved_rows([first, stale])
    other = saved_run(tmp_path / "d.json", "pristine", rounds("native", [100]), gpu="H100")
    with pytest.raises(SystemExit, match=r"a\.json and .*d\.json were measured differently \(gpu "):
        transfer_bench.saved_rows([first, other])
    with pytest.raises(SystemExit, match=r"a\.json: given twice"):
        transfer_bench.saved_rows([first, str(tmp_path / "." / "a.json")])
    (tmp_path / "e.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match=r"e\.json: not a transfer_bench.py --out file"):
        transfer_bench.saved_rows([str(tmp_path / "e.json")])


def test_table_pairs_rounds_with_their_own_native_and_sign_tests_each_set_of_processes(tmp_path):
    # Each run: two sets of two rounds (--rounds 2 --process-sets 2); three runs, six sets.
    def timed(mode, batch, sets):
        return [dict(row(mode, 5.0, kernel_us=t, batch=batch), round=2 * k + i)
                for k, pair in enumerate(sets) for i, t in enumerate(pair)]

    def run(name, native, contig, per_layer):
        rows = [r for batch in (64, 256) for r in timed("native", batch, [[native] * 2] * 2)]
        rows += timed("kvcached-contiguous", 64, [[contig] * 2] * 2)   # slower in every set
        rows += timed("kvcached-per-layer", 256, per_layer)            # slower in 2 of 6 sets
        return saved_run(tmp_path / f"{name}.json", "pristine", rows, rounds=2)
    # run b's native takes twice as long: its variants pair with its own native
    runs = [run("a", 100, 100.5, [[99, 99], [99, 99]]), run("b", 200, 201, [[198, 198], [202, 202]]),
            run("c", 100, 100.5, [[99, 99], [300, 99]])]
    text = transfer_bench.table(transfer_bench.saved_rows(runs))
    low = statistics.median([100 / 100.5] * 8 + [200 / 201] * 4)
    assert (f"p < 0.05): kvcached-contiguous, MLA load layer_first 64: 6 of 6 sets, median {low:.4f} "
            "(of 2 cells; chance alone would name 0.0)") in text
    assert "none (the test needs 5 sets of processes a cell; these runs have 2)" in \
        transfer_bench.table(transfer_bench.saved_rows(runs[:1]))
    assert [transfer_bench.sign_test(k, n - k) for k, n in ((5, 5), (0, 7), (12, 15))] == [1 / 32, 1.0, 576 / 2 ** 15]


def test_a_committed_run_tables_on_a_machine_without_a_gpu():
    proc = cli("--table", "bench/results/2026-12-01-h200-rounds/results.json")
    assert proc.returncode == 0, proc.stderr
    timed = [line.split("|")[5] for line in proc.stdout.splitlines() if line.startswith(("| MHA", "| MLA"))]
    assert len(timed) == 2 * 2 * 6 and all(float(gbps) > 0 for gbps in timed)   # native GB/s, every cell
    assert "byte-exact load-back checks: 8 of 8 pass" in proc.stdout
    assert "pinned copy (1 GiB): D2H 55.3 GB/s, H2D 55.5 GB/s" in proc.stdout


def test_a_run_without_the_link_part_says_so_instead_of_a_zero_link():
    proc = cli("--table", *(f"bench/results/2026-12-04-h200-six-patches/{p}.json" for p in ("mha", "mla", "mamba")))
    assert proc.returncode == 0, proc.stderr
    assert "byte-exact load-back checks: 15 of 15 pass" in proc.stdout
    assert "pinned copy: not measured (no link part)" in proc.stdout and "0.0 GB/s" not in proc.stdout


# --- bench/plot.py: what it cannot draw, in one line ----------------------------------------

def refused(src, dst, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        plot.main(str(src), str(dst))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1
    return err


PLOTTED = ROOT / "bench/results/2026-11-30-h200-all-parts/results.json"


def test_plot_refuses_a_run_it_cannot_read_an_image_it_cannot_write_or_no_matplotlib(tmp_path, capsys, monkeypatch):
    for name, content in (("missing", None), ("bad", b"{"), ("binary", bytes(range(256))), ("list", b"[]")):
        if content is not None:
            (tmp_path / f"{name}.json").write_bytes(content)
        assert "not a transfer_bench.py --out file it can read" in refused(tmp_path / f"{name}.json", "o.png", capsys)
    (tmp_path / "empty.json").write_text(json.dumps({"meta": {}, "rows": [dict(mode="pinned-copy", pool="link")]}))
    assert "no measured rows to draw" in refused(tmp_path / "empty.json", "o.png", capsys)
    (tmp_path / "folder").mkdir()
    assert "name an image file (png, svg" in refused(PLOTTED, tmp_path / "folder", capsys)
    assert not (tmp_path / "folder.png").exists()
    assert "name an image file (png, svg" in refused(PLOTTED, tmp_path / "o.txt", capsys)
    assert f"no folder {tmp_path / 'no'}" in refused(PLOTTED, tmp_path / "no" / "o.png", capsys)
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # not installed
    assert "needs matplotlib" in refused(PLOTTED, tmp_path / "o.png", capsys)
