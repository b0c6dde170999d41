"""bench/bench_server.py (`make bench-server`) against stand-in servers, on the CPU.

The servers are tests/support/bench_fake_server.py as `sglang.launch_server` in two trees
made here. The whole tool runs against them twice: with a stand-in client whose numbers
are set per variant and drift from run to run (tests/support/bench_fake_client.py), so
that the ratios, their spread and the report can be checked against arithmetic done
here; and with SGLang 0.5.20's own client (`python -m sglang.bench_serving`, from the
pristine tree) on a small workload, single-turn and multi-turn, to check the flags it is
given, the tokenizer written for it and the results read from it.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(SUPPORT))
import bench_server as bench  # noqa: E402
import servers  # noqa: E402

pytestmark = pytest.mark.project_files
VARIANTS = ["native", "kvcached-contiguous", "kvcached-per-layer", "native-no-hicache"]
IDENTITY = {"native": (None, True), "kvcached-contiguous": ("contiguous", True),
            "kvcached-per-layer": ("per-layer", True), "native-no-hicache": (None, False),
            "kvcached-no-hicache": ("contiguous", False)}
SMALL = ["--groups", "2", "--prompts-per-group", "2", "--system-prompt-len", "48", "--question-len", "8",
         "--output-len", "4", "--concurrency", "2", "--device-tokens", "4096", "--ready-timeout", "60",
         "--bench-timeout", "240"]


@pytest.fixture
def trees(tmp_path, monkeypatch):
    for tree in ("pristine", "patched"):
        pkg = tmp_path / tree / "sglang"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        shutil.copy(SUPPORT / "bench_fake_server.py", pkg / "launch_server.py")
    monkeypatch.setattr(bench.servers, "check_trees", lambda pristine, patched: {"pristine": "fake", "patched": "fake"})
    monkeypatch.setattr(bench.servers, "machine", lambda python, tree=None: {"fake": True})
    for var in ("FAKE_CLIENT_FAIL_ON", "FAKE_DIE_LAYOUT"):
        monkeypatch.delenv(var, raising=False)
    return ["--pristine-path", str(tmp_path / "pristine"), "--patched-path", str(tmp_path / "patched"),
            "--port", str(servers.free_port_block(len(VARIANTS)))]


def fake_client() -> list[str]:
    return ["--bench-client", f"{sys.executable} {SUPPORT / 'bench_fake_client.py'}"]


def expected(variant: str, rnd: int, warmups: int = 1) -> float:
    """The stand-in client's request throughput of a variant's run in round rnd (0-based):
    each server serves one run a round, after its warm-up runs (default --warmup-rounds 1)."""
    from bench_fake_client import SPEEDS
    speed, drift = SPEEDS[IDENTITY[variant]]
    return speed * (1 + drift * (rnd + warmups))


def test_ratios_spread_and_report_against_stand_in_servers(trees, tmp_path, capsys):
    out = tmp_path / "run"
    assert bench.main([*trees, *SMALL, *fake_client(), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["problems"] == []
    shape = report["shapes"]["llama3-8b"]
    assert all(s["outcome"] == "ready" for s in shape["servers"].values())
    # each server started once, all side by side: its log has one start
    assert all(Path(s["log"]).read_text().count("fake bench server up") == 1 for s in shape["servers"].values())
    w = shape["workloads"]["shared-prefix"]
    # every round each variant once, the order rotated by one a round
    for rnd in range(3):
        order = [r["variant"] for r in sorted((r for r in w["runs"] if r["round"] == rnd), key=lambda r: r["position"])]
        assert order == VARIANTS[rnd:] + VARIANTS[:rnd]
    for v in VARIANTS:
        got = w["summary"][v]["metrics"]
        rps = [expected(v, r) for r in range(3)]
        ratios = [x / expected("native", r) for r, x in enumerate(rps)]
        assert got["request_throughput"]["values"] == pytest.approx(rps)
        assert got["request_throughput"]["ratios"] == pytest.approx(ratios)
        assert got["output_throughput"]["ratios"] == pytest.approx(ratios)
        assert got["request_throughput"]["ratio"] == pytest.approx(statistics.median(ratios))
        assert (got["request_throughput"]["min"], got["request_throughput"]["max"]) == pytest.approx(
            (min(ratios), max(ratios)))
        ttft = [1 / x for x in ratios]                       # latency: the inverse of the speed
        for m in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms"):
            assert got[m]["ratios"] == pytest.approx(ttft)
            assert (got[m]["min"], got[m]["max"]) == pytest.approx((min(ttft), max(ttft)))
        cache = w["summary"][v]["cache"]
        host = 600 if IDENTITY[v][1] else 0
        assert (cache["device_tokens"], cache["host_tokens"]) == (3 * (800 - host), 3 * host)
        assert cache["host_share"] == pytest.approx(host / 800)
    # contiguous: 0.99 in round 1 (1.03 in the warm-up, not counted), below 0.98 later; per-layer
    # about 0.9 every round
    targets = {v: w["summary"][v].get("targets") for v in VARIANTS}
    assert targets["kvcached-contiguous"]["request_throughput"] == "within spread"
    assert targets["kvcached-per-layer"] == dict.fromkeys(bench.TARGETS, "short")
    assert targets["native"] is None and targets["native-no-hicache"] is None
    # the summary shows each variant's ratio and spread; --render prints the same
    summary = (out / "summary.md").read_text()
    r = w["summary"]["kvcached-contiguous"]["metrics"]["request_throughput"]
    assert any("kvcached-contiguous" in line and f"{r['ratio']:.3f} ({r['min']:.3f}-{r['max']:.3f})" in line
               for line in summary.splitlines())
    assert "kvcached-per-layer against the targets" in summary
    capsys.readouterr()
    assert bench.main(["--render", str(out / "report.json")]) == 0
    assert capsys.readouterr().out == summary
    # the warm-up round ran first, every variant once, at the speeds of a server's first run,
    # and none of it is in the ratios above
    assert [(r["variant"], r["position"]) for r in w["warmup"]] == [(v, i) for i, v in enumerate(VARIANTS)]
    assert [r["metrics"]["request_throughput"] for r in w["warmup"]] == pytest.approx(
        [expected(v, -1) for v in VARIANTS])
    # the client's own result lines are kept, one a run
    assert len(list((out / "raw" / "llama3-8b" / "shared-prefix").glob("r*.jsonl"))) == 12
    assert len(list((out / "raw" / "llama3-8b" / "shared-prefix").glob("w1-*.jsonl"))) == 4


def test_a_failed_client_or_a_dead_server_is_a_problem_and_the_rest_is_kept(trees, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_CLIENT_FAIL_ON", "contiguous")
    out = tmp_path / "run"
    args = [*trees, *SMALL, *fake_client(), "--out", str(out), "--env", "FAKE_DIE_LAYOUT=per-layer",
            "--warmup-rounds", "0"]
    assert bench.main(args) == 1
    report = json.loads((out / "report.json").read_text())
    problems = report["problems"]
    assert sum("kvcached-contiguous: the client exited 1" in p for p in problems) == 3
    # per-layer's server dies at the second flush: round 2 fails with it, round 3 finds it gone
    assert any(p.startswith("llama3-8b/shared-prefix round 2 kvcached-per-layer") and "the server died" in p
               for p in problems)
    assert any(p == "llama3-8b/shared-prefix round 3 kvcached-per-layer: the server is not running" for p in problems)
    w = report["shapes"]["llama3-8b"]["workloads"]["shared-prefix"]
    per_layer = w["summary"]["kvcached-per-layer"]["metrics"]["request_throughput"]
    assert per_layer["ratios"][0] == pytest.approx(0.9) and per_layer["ratios"][1:] == [None, None]
    assert w["summary"]["native-no-hicache"]["metrics"]["request_throughput"]["ratios"] == pytest.approx(
        [expected("native-no-hicache", r, 0) / expected("native", r, 0) for r in range(3)])
    assert "## Problems" in (out / "summary.md").read_text()


def test_kvcached_without_hicache_is_judged_against_native_without_hicache(trees, tmp_path):
    # kvcached's own cost, apart from HiCache's copies: its ratios divide by native-no-hicache's
    out = tmp_path / "run"
    variants = ["native", "native-no-hicache", "kvcached-no-hicache"]
    assert bench.main([*trees, *SMALL, *fake_client(), "--out", str(out), "--warmup-rounds", "0",
                       "--variants", *variants]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["problems"] == []
    w = report["shapes"]["llama3-8b"]["workloads"]["shared-prefix"]
    own = w["summary"]["kvcached-no-hicache"]
    assert own["metrics"]["request_throughput"]["ratios"] == pytest.approx(
        [expected("kvcached-no-hicache", r, 0) / expected("native-no-hicache", r, 0) for r in range(3)])
    assert own["cache"]["host_tokens"] == 0 and "targets" not in own
    assert any(line.startswith("| kvcached-no-hicache (to native-no-hicache) |")
               for line in (out / "summary.md").read_text().splitlines())


def test_runs_past_the_deadline_are_not_run_and_say_so(trees, tmp_path):
    out = tmp_path / "run"
    assert bench.main([*trees, *SMALL, *fake_client(), "--out", str(out), "--deadline", "0"]) == 1
    report = json.loads((out / "report.json").read_text())
    runs = report["shapes"]["llama3-8b"]["workloads"]["shared-prefix"]["runs"]
    warmup = report["shapes"]["llama3-8b"]["workloads"]["shared-prefix"]["warmup"]
    assert len(runs) == 12 and all(r["error"] == "not run: --deadline 0 s had passed" for r in runs + warmup)
    assert len(warmup) == 4
    assert sum(p.startswith("llama3-8b/shared-prefix warm-up 1 ") for p in report["problems"]) == 4
    assert not list((out / "raw").rglob("*.jsonl"))


def test_sglangs_own_client_single_and_multi_turn_against_a_stand_in_server(trees, tmp_path):
    client = os.environ.get("PRISTINE_SGLANG")
    if not client or not (Path(client) / "sglang" / "benchmark" / "serving.py").is_file():
        pytest.fail("PRISTINE_SGLANG must name the pristine tree's python/ folder (make test sets it)")
    out = tmp_path / "run"
    args = [*trees, *SMALL, "--out", str(out), "--variants", "native", "--rounds", "1", "--turns", "1", "2",
            "--client-path", client]
    code = bench.main(args)
    report = json.loads((out / "report.json").read_text())
    assert code == 0, report["problems"]
    for name, answers in (("shared-prefix", 4), ("multi-turn-2", 8)):
        (run,) = report["shapes"]["llama3-8b"]["workloads"][name]["runs"]
        m, cache = run["metrics"], run["cache"]
        assert m["completed"] == answers and m["request_throughput"] > 0 and m["median_ttft_ms"] > 0
        assert m["median_itl_ms"] > 0 and m["total_output_tokens"] == answers * 4
        # the prompts of a group share their system prompt (a turn, the turns before it): the
        # stand-in serves three quarters of each request's hit from host, rounded down
        host, device = cache["host_cached_tokens"], cache["device_cached_tokens"]
        assert host >= 48 and 0 <= 3 * device - host <= 3 * answers
    single = report["shapes"]["llama3-8b"]["workloads"]["shared-prefix"]["runs"][0]["metrics"]
    assert single["total_input_tokens"] == 4 * (48 + 8)        # system prompt and question, word for word


def test_the_tokenizer_round_trips_any_ids_and_its_turns_extend_each_other(tmp_path):
    from transformers import AutoTokenizer
    import random
    folder = bench.write_model(tmp_path / "m", bench.SHAPES["deepseek-v2-lite"], 9000)
    tok = AutoTokenizer.from_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    assert len(tok.get_vocab()) == config["vocab_size"] and config["max_position_embeddings"] == 9000
    rng = random.Random(0)
    ids = [rng.randrange(config["vocab_size"]) for _ in range(300)]
    assert tok.encode(tok.decode(ids)) == ids
    turns = [{"role": "user", "content": tok.decode(ids[:100])}, {"role": "assistant", "content": tok.decode(ids[100:120])},
             {"role": "user", "content": tok.decode(ids[120:])}]
    first = tok.apply_chat_template(turns[:1], tokenize=True, add_generation_prompt=True)
    later = tok.apply_chat_template(turns, tokenize=True, add_generation_prompt=True)
    first, later = (x["input_ids"] if isinstance(x, dict) or hasattr(x, "keys") else x for x in (first, later))
    assert later[:len(first)] == first and later[:100] == ids[:100]


def test_shapes_reach_their_pool_kinds_through_sglangs_model_config(tmp_path):
    from sglang.srt.configs.hybrid_arch import hybrid_gdn_config
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    def config(name):
        return ModelConfig(str(bench.write_model(tmp_path / name, bench.SHAPES[name], 8192)), trust_remote_code=False,
                           dtype="auto")
    mha = config("llama3-8b")
    assert mha.attention_arch == AttentionArch.MHA and mha.get_total_num_kv_heads() == 8 and mha.head_dim == 128
    assert mha.num_hidden_layers == 32
    mla = config("deepseek-v2-lite")
    assert mla.attention_arch == AttentionArch.MLA and (mla.kv_lora_rank, mla.qk_rope_head_dim) == (512, 64)
    assert mla.num_hidden_layers == 27 and mla.hf_config.first_k_dense_replace >= 27   # dense MLPs: no MoE op
    gdn = hybrid_gdn_config(config("qwen3.5-4b"))
    assert gdn is not None and gdn.full_attention_layer_ids == list(range(3, 32, 4)) and len(gdn.linear_layer_ids) == 24


def parse(args):
    import argparse

    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(args)


def test_server_flags_parse_with_sglangs_parser_and_differ_in_hicache_only(tmp_path):
    sizes = bench.Sizes()
    for shape in bench.SHAPES.values():
        parsed = {}
        for v in VARIANTS:
            ns = parse(bench.server_args(shape, bench.VARIANTS[v], tmp_path, 30000, sizes, 3, 0.8))
            assert ns.max_total_tokens == sizes.device_tokens and ns.load_format == "dummy"
            assert ns.page_size == shape.page_size and ns.mem_fraction_static == 0.8
            assert not ns.disable_cuda_graph                                 # SGLang's CUDA graphs on
            assert ns.enable_hierarchical_cache == bench.VARIANTS[v].hicache
            parsed[v] = {k: x for k, x in vars(ns).items() if k not in ("enable_hierarchical_cache", "hicache_ratio")}
        assert all(p == parsed["native"] for p in parsed.values())
    env = bench.server_env(bench.SHAPES["qwen3.5-4b"], bench.VARIANTS["kvcached-per-layer"], "ipc", -1)
    assert env["KVCACHED_CONTIGUOUS_LAYOUT"] == "false" and env["KVCACHED_PAGE_SIZE_MB"] == "4"
    assert bench.server_env(bench.SHAPES["llama3-8b"], bench.VARIANTS["native"], "ipc", -1) == {"ENABLE_KVCACHED": "false"}
    kept = bench.server_env(bench.SHAPES["llama3-8b"], bench.VARIANTS["kvcached-contiguous-reserved"], "ipc", -1)
    assert kept == {**bench.server_env(bench.SHAPES["llama3-8b"], bench.VARIANTS["kvcached-contiguous"], "ipc", -1),
                    "KVCACHED_MAX_RESERVED_PAGES": "1000000"}             # only the unmapping differs


def test_the_host_pool_holds_the_working_set_and_the_default_run_fits_in_memory():
    sizes = bench.Sizes()
    for turns in (1, 2, 4):
        ratio = bench.hicache_ratio(sizes, turns)
        assert ratio * sizes.device_tokens >= 1.2 * sizes.working_set(turns) > (ratio - 1) * sizes.device_tokens
        assert sizes.working_set(turns) > 2 * sizes.device_tokens       # most hits must come back from host
    # Llama-3-8B: 128 KiB of KV a token; three HiCache servers of the default run under 60 GiB
    per_server = bench.host_pool_bytes(bench.SHAPES["llama3-8b"], sizes, bench.hicache_ratio(sizes, 1))
    assert per_server == 3 * sizes.device_tokens * 32 * 2 * 8 * 128 * 2 and 3 * per_server < 60 * 2**30


def test_bad_input_is_refused_in_one_line(capsys, tmp_path):
    trees = ["--pristine-path", str(tmp_path), "--patched-path", str(tmp_path)]
    (tmp_path / "file").write_text("")
    for args, message in ((["--variants", "kvcached-contiguous"], "must name native"),
                          (["--rounds", "0"], "--rounds must be at least 1"),
                          (["--device-tokens", "1000"], "would not fit in a device pool of 1000"),
                          (["--hicache-ratio", "1"], "--hicache-ratio must be at least 2"),
                          (["--env", "NOEQUALS"], "KEY=VALUE"),
                          (["--variants", "native", "kvcached-no-hicache"], "kvcached-no-hicache needs native-no-hicache"),
                          (["--dry-run"], "--pristine-path and --patched-path are needed"),
                          ([*trees, "--out", str(tmp_path / "file")], "cannot make the folder"),
                          ([*trees, "--out", str(tmp_path / "file" / "run")], "cannot make the folder"),
                          ([*trees, "--server-flags", '"x'], "--server-flags '\"x': No closing quotation"),
                          ([*trees, "--bench-client", '"x'], "--bench-client '\"x': No closing quotation")):
        with pytest.raises(SystemExit) as exc:
            bench.options(args)
        assert exc.value.code == 2 and message in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{")
    assert bench.main(["--render", str(tmp_path / "bad.json")]) == 2
    assert "cannot read the report" in capsys.readouterr().err
    for report in ("{}", "[]", (ROOT / "docs/runs/soak/2026-12-02-h200-real-kernels/report.json").read_text()):
        (tmp_path / "other.json").write_text(report)
        assert bench.main(["--render", str(tmp_path / "other.json")]) == 2
        assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'other.json'}: not a bench_server.py report")
    with pytest.raises(SystemExit, match="need more than 80 % of the"):
        bench.Bench(bench.options([*trees, "--device-tokens", str(10**8), "--out", str(tmp_path / "x")])).check_memory()


def test_plot_of_another_tools_report_is_refused_in_one_line(capsys, tmp_path):
    for report in ("{}", "[]"):
        (tmp_path / "other.json").write_text(report)
        assert bench.main(["--plot", str(tmp_path / "other.json"), str(tmp_path / "o.png")]) == 2
        assert "not a bench_server.py report" in capsys.readouterr().err


def test_targets_are_met_within_the_spread_or_short():
    stat = lambda ratio, low, high: {"ratio": ratio, "min": low, "max": high}
    assert bench.target_verdict(stat(0.99, 0.97, 1.0), 0.98) == "met"
    assert bench.target_verdict(stat(0.97, 0.96, 0.985), 0.98) == "within spread"
    assert bench.target_verdict(stat(0.97, 0.96, 0.975), 0.98) == "short"
    assert bench.target_verdict(stat(1.01, 1.0, 1.03), 1.02) == "met"
    assert bench.target_verdict(stat(1.03, 1.01, 1.05), 1.02) == "within spread"
    assert bench.target_verdict(stat(1.03, 1.025, 1.05), 1.02) == "short"
    assert bench.target_verdict(stat(None, None, None), 1.02) == "not measured"
    one_round = {"ratio": 1.18, "min": 1.18, "max": 1.18, "ratios": [1.18, None, None]}
    assert bench.target_verdict(one_round, 0.98) == "not judged (one round: no spread)"
    assert bench.target_verdict({**one_round, "ratios": [1.18, 0.99, None]}, 0.98) == "met"
