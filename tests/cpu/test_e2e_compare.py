"""tests/e2e: the model-level comparison's matrix, server flags, traffic, verdicts and runner.

The comparison itself needs GPUs (docs/e2e-results.md holds its runs); what it decides is
checked here: every row's flags parse with SGLang 0.5.20's own parser into the intended
settings; variants differ only in tree and kvcached environment; the tiny configs reach
each pool kind through SGLang's own model config; the traffic can produce host and
storage hits; the verdicts catch every kind of divergence, record the pristine tree's
failure as expected, and fail a pristine row that matches; and the whole runner, driven
against a stand-in server process, writes the report it promises.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gzip
import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.support import fake_mooncake_master

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.project_files
sys.path.insert(0, str(ROOT / "tests" / "e2e"))
import compare_servers as e2e  # noqa: E402
import servers  # noqa: E402
import e2e_matrix as matrix  # noqa: E402
import e2e_verdict as verdict  # noqa: E402
import mooncake_store  # noqa: E402

# what the runs in docs/e2e-results.md passed besides the matrix's own flags
STANDIN_FLAGS = ("--attention-backend triton --sampling-backend pytorch --disable-cuda-graph --grammar-backend none "
                 "--mem-fraction-static 0.3 --disable-custom-all-reduce --linear-attn-prefill-backend triton")
ALL_CASES = [matrix.CASES[n] for n in sorted(matrix.CASES)]


def parse(args):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(args)


# ---------------------------------------------------------------- matrix and flags

def test_every_rows_flags_parse_with_sglangs_parser():
    plan = matrix.Plan()
    rows = matrix.build_rows(ALL_CASES, l3="also")
    assert {r.l3 for r in rows} == {False, True} and {r.host_layout for r in rows} == set(matrix.HOST_LAYOUTS)
    for row in rows:
        ns = parse(matrix.server_args(row, 30010, plan, [*STANDIN_FLAGS.split(), "--nccl-port", "30011"]))
        assert ns.model_path == row.case.model and ns.port == 30010 and ns.nccl_port == 30011
        assert ns.enable_hierarchical_cache is True
        assert ns.hicache_mem_layout == row.host_layout
        assert ns.hicache_io_backend == "kernel" and ns.hicache_write_policy == "write_through"  # SGLang's defaults
        assert ns.hicache_ratio == (plan.l3_hicache_ratio if row.l3 else plan.hicache_ratio)
        assert ns.hicache_storage_backend == ("file" if row.l3 else None)
        assert ns.hicache_storage_prefetch_policy == ("wait_complete" if row.l3 else "timeout")
        assert ns.tp_size == row.case.tp and ns.pp_size == row.case.pp and ns.page_size == (1 if row.case.pool == "mla" else plan.page_size)
        assert ns.max_total_tokens == plan.device_tokens and ns.skip_tokenizer_init is True
        assert (ns.load_format == "dummy") == row.case.dummy
        assert ns.attention_backend == "triton" and ns.disable_custom_all_reduce is True
        if row.case.pool == "mamba":
            assert ns.max_mamba_cache_size > 0


def test_default_host_layout_is_left_to_sglang():
    row = matrix.build_rows([matrix.CASES["qwen2-tiny"]], ["page_first"], ["native"])[0]
    assert "--hicache-mem-layout" not in matrix.server_args(row, 1, matrix.Plan())


def test_variants_differ_only_in_tree_and_kvcached_environment():
    case = matrix.CASES["qwen3.5-tiny"]
    plan = matrix.Plan()
    rows = {r.variant.name: r for r in matrix.build_rows([case], ["page_first"])}
    assert set(rows) == set(matrix.DEFAULT_VARIANTS)
    assert len({tuple(matrix.server_args(r, 1, plan)) for r in rows.values()}) == 1
    assert matrix.server_env(rows["native"]) == {"ENABLE_KVCACHED": "false"}
    for name, contiguous in (("elastic-contiguous", "true"), ("elastic-per-layer", "false"),
                             ("pristine-contiguous", "true"), ("pristine-per-layer", "false")):
        env = matrix.server_env(rows[name])
        assert env["ENABLE_KVCACHED"] == "true" and env["KVCACHED_MAX_CACHED_TOKENS"] == "-1"
        assert env["KVCACHED_CONTIGUOUS_LAYOUT"] == contiguous and env["KVCACHED_PAGE_SIZE_MB"] == "4"
    assert {rows[n].variant.tree for n in rows} == {"pristine", "patched"}
    assert rows["native"].variant.tree == "pristine" and rows["elastic-contiguous"].variant.tree == "patched"
    mha = matrix.build_rows([matrix.CASES["qwen2-tiny"]], ["page_first"], ["native", "elastic-contiguous"])
    assert "KVCACHED_PAGE_SIZE_MB" not in matrix.server_env(mha[1])


def test_every_kvcached_server_has_its_own_ipc_name_and_l3_its_own_store():
    rows = matrix.build_rows([matrix.CASES[n] for n in matrix.CASE_SETS["tiny"]], l3="also")
    names = [matrix.server_env(r, "/s")["KVCACHED_IPC_NAME"] for r in rows if r.variant.kvcached]
    assert len(names) == len(set(names)) and all("/" not in n and "." not in n for n in names)
    l3 = next(r for r in rows if r.l3)
    assert matrix.server_env(l3, "/tmp/x")["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] == "/tmp/x"
    with pytest.raises(ValueError, match="storage directory"):
        matrix.server_env(l3)


def keys(rows):
    return {(r.host_layout, r.l3, r.variant.name, r.expect) for r in rows}


def test_rows_per_pool_kind():
    mha = matrix.build_rows([matrix.CASES["qwen2-tiny"]], l3="also")
    assert keys(mha) == {
        *{(h, False, v, "match") for h in matrix.HOST_LAYOUTS for v in ("native", "elastic-contiguous", "elastic-per-layer")},
        *{(h, False, "pristine-contiguous", "fail") for h in matrix.HOST_LAYOUTS},
        *{("page_first", True, v, "match") for v in ("native", "elastic-contiguous", "elastic-per-layer")}}
    mamba = matrix.build_rows([matrix.CASES["qwen3.5-tiny"]])
    assert keys(mamba) == {
        *{("page_first", False, v, "match") for v in ("native", "elastic-contiguous", "elastic-per-layer")},
        *{("page_first", False, v, "fail") for v in ("pristine-contiguous", "pristine-per-layer")},
        ("layer_first", False, "native", "refused"), ("layer_first", False, "elastic-contiguous", "refused")}
    refused = next(r for r in mamba if r.expect == "refused")
    assert refused.refusal == "Unsupported layout: layer_first"
    assert all(r.variant.name == "native" for r in matrix.build_rows([matrix.CASES["mellum-tiny"]])[:1])
    only = matrix.build_rows([matrix.CASES["qwen2-tiny"]], l3="only")
    assert {r.l3 for r in only} == {True} and {r.host_layout for r in only} == {"page_first"}
    # a case whose L3 group cannot run natively in reasonable time: one row saying why
    (mla_l3,) = [r for r in matrix.build_rows([matrix.CASES["deepseek-v2-tiny"]], l3="also") if r.l3]
    assert mla_l3.variant.name == "native" and "file store" in mla_l3.not_run


def test_bad_matrix_input_is_refused_with_what_to_use():
    case = matrix.CASES["qwen2-tiny"]
    with pytest.raises(ValueError, match="oracle"):
        matrix.build_rows([case], variants=["elastic-contiguous"])
    with pytest.raises(ValueError, match="unknown variants"):
        matrix.build_rows([case], variants=["native", "elastic"])
    with pytest.raises(ValueError, match="host layouts"):
        matrix.build_rows([case], host_layouts=["page_head"])
    with pytest.raises(ValueError, match="--l3"):
        matrix.build_rows([case], l3="yes")
    with pytest.raises(ValueError, match="unknown cases"):
        matrix.select_cases(["qwen9"])
    with pytest.raises(ValueError, match="no case selected"):
        matrix.select_cases()
    with pytest.raises(ValueError, match="pool"):
        matrix.Case("x", "m", "paged")


def test_rows_can_be_left_out_by_key():
    rows = matrix.build_rows([matrix.CASES["qwen2-tiny"], matrix.CASES["qwen2-tiny-tp2"]], l3="also")
    kept = matrix.skip_rows(rows, ["*-tp2/layer_first/*", "qwen2-tiny/page_first/l3/*"])
    assert len(kept) == len(rows) - 4 - 3
    assert not any(r.key.startswith("qwen2-tiny-tp2/layer_first/") for r in kept)
    assert any(r.key.startswith("qwen2-tiny-tp2/page_first/l3/") for r in kept)
    assert matrix.skip_rows(rows) == rows


def test_run_order_starts_every_case_default_layout_first():
    rows = matrix.build_rows([matrix.CASES[n] for n in matrix.CASE_SETS["tiny"]], l3="also")
    order = [rows[i] for i in matrix.run_order(rows)]
    assert sorted(matrix.run_order(rows)) == list(range(len(rows)))
    first = order[:len(matrix.CASE_SETS["tiny"])]
    assert {r.case.name for r in first} == set(matrix.CASE_SETS["tiny"]) and {r.variant.name for r in first} == {"native"}
    tiers = [0 if (r.host_layout == "page_first" and not r.l3) else 1 if r.l3 else 2 for r in order]
    assert tiers == sorted(tiers)


def test_cases_per_pool_kind():
    assert [c.name for c in matrix.select_cases(pools=["mha"])] == ["qwen2-tiny", "qwen2-tiny-tp2", "qwen2-tiny-pp2"]
    every = matrix.select_cases(pools=["all"])
    assert {c.pool for c in every} == set(matrix.POOL_KINDS) and {(c.tp, c.pp) for c in every} == {(1, 1), (2, 1), (1, 2)}
    assert all(c.dummy for c in every)
    assert {c.pool for c in matrix.select_cases(pools=["all"], case_set="hf")} == set(matrix.POOL_KINDS)
    assert [c.name for c in matrix.select_cases(["mellum-tiny"], ["swa"])] == ["mellum-tiny"]


# ---------------------------------------------------------------- traffic

@pytest.mark.parametrize("l3", [False, True])
def test_traffic_pushes_the_set_out_of_the_tier_under_test(l3):
    plan = matrix.Plan()
    t = matrix.traffic(plan, 1024, l3)
    unique = {tuple(p[:i]) for p in t.pass1 for i in range(1, len(p) + 1)}   # distinct prefixes = tokens held
    filler = sum(map(len, t.filler))
    assert len(unique) + len(t.pass1) * plan.max_new_tokens <= plan.device_tokens   # pass 1 fits on device
    assert filler > plan.device_tokens
    if l3:
        assert filler > plan.host_tokens(True)          # ... and out of host memory
    else:
        assert plan.host_tokens(False) >= len(unique) + filler + (len(t.pass1) + len(t.filler)) * plan.max_new_tokens
    assert t.pass2[:len(t.pass1)] == t.pass1 and len(t.pass2) == len(t.pass1) + plan.extension_prompts
    assert matrix.traffic(plan, 1024, l3) == t                               # every server sees the same ids


def test_traffic_has_shared_and_distinct_prefixes():
    plan = matrix.Plan()
    t = matrix.traffic(plan, 1024, False)
    distinct, shared = t.pass1[:plan.distinct_prompts], t.pass1[plan.distinct_prompts:] + t.pass2[len(t.pass1):]
    n = plan.shared_prefix_tokens
    assert len({tuple(p[:n]) for p in shared}) == 1 and len({tuple(p[n:n + 8]) for p in shared}) == len(shared)
    assert len({tuple(p[:8]) for p in distinct + t.filler + shared[:1]}) == len(distinct) + len(t.filler) + 1
    assert all(len(p) == plan.prompt_tokens for p in t.pass2 + t.filler)
    assert all(100 <= i < 1024 for p in t.pass2 for i in p)


# ---------------------------------------------------------------- tiny configs

def model_config(case_name):
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(matrix.CASES[case_name].model, trust_remote_code=False, dtype="auto")


def test_tiny_configs_reach_each_pool_kind_through_sglangs_model_config():
    from sglang.srt.configs.hybrid_arch import hybrid_gdn_config
    from sglang.srt.configs.model_config import AttentionArch

    mha = model_config("qwen2-tiny")
    assert mha.attention_arch == AttentionArch.MHA and not mha.is_hybrid_swa and hybrid_gdn_config(mha) is None
    # per rank at TP 2: one KV head of 64 bf16, a row the JIT HiCache kernel takes
    assert mha.get_total_num_kv_heads() % 2 == 0 and (mha.head_dim * 2) % 128 == 0
    mla = model_config("deepseek-v2-tiny")
    assert mla.attention_arch == AttentionArch.MLA
    assert ((mla.kv_lora_rank + mla.qk_rope_head_dim) * 2) % 128 == 0             # 576 bf16
    hf = mla.hf_config
    assert hf.first_k_dense_replace >= hf.num_hidden_layers                        # dense MLPs only: no MoE op
    gdn = model_config("qwen3.5-tiny")
    text = hybrid_gdn_config(gdn)
    assert text is not None and text.linear_layer_ids == [0, 1, 2] and text.full_attention_layer_ids == [3]
    ssm = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim * 4   # fp32
    conv = (2 * text.linear_num_key_heads * text.linear_key_head_dim
            + text.linear_num_value_heads * text.linear_value_head_dim) * (text.linear_conv_kernel_dim - 1) * 2
    assert ssm + conv > 2 << 20   # over kvcached's default page: KVCACHED_PAGE_SIZE_MB=4, as Qwen3.5-4B
    swa = model_config("mellum-tiny")
    assert swa.is_hybrid_swa and swa.swa_attention_layer_ids == [0, 1, 2] and swa.full_attention_layer_ids == [3]
    assert set(swa.hf_config.mlp_layer_types) == {"dense"}                        # no MoE op


def draft_config_of(case_name):
    """The draft's ModelConfig as SGLang's draft worker builds it, from the case's flags."""
    from sglang.srt.configs.model_config import ModelConfig

    flags = matrix.CASES[case_name].extra_flags
    path = flags[flags.index("--speculative-draft-model-path") + 1]
    return ModelConfig(path, trust_remote_code=False, dtype="auto", is_draft_model=True)


def test_mtp_cases_take_sglangs_packed_and_sidecar_host_pool_plans():
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.speculative.base_spec_worker import _can_pack_hicache_mtp
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    eagle = SpeculativeAlgorithm.from_string("EAGLE")
    for name, packed in (("mimo-tiny-mtp", True), ("qwen2-tiny-eagle", False)):
        case = matrix.CASES[name]
        assert case.draft == ("packed" if packed else "sidecar")
        assert case.extra_flags[case.extra_flags.index("--speculative-algorithm") + 1] == "EAGLE"
        target, draft = model_config(name), draft_config_of(name)
        assert target.attention_arch == draft.attention_arch == AttentionArch.MHA
        assert _can_pack_hicache_mtp(eagle, (SimpleNamespace(model_config=draft),)) is packed
    assert draft_config_of("mimo-tiny-mtp").hf_config.architectures == ["MiMoMTP"]
    assert draft_config_of("qwen2-tiny-eagle").hf_config.architectures == ["Qwen2ForCausalLMEagle"]


def test_direct_io_rows_expect_the_series_refusal_where_views_are_strided():
    rows = {r.key: r for r in matrix.build_rows([matrix.CASES["qwen2-tiny"], matrix.CASES["qwen3.5-tiny"]],
                                                 io_backends=("kernel", "direct"))}
    direct = rows["qwen2-tiny/page_first/direct/elastic-contiguous"]
    assert (direct.expect, direct.refusal) == ("refused", matrix.DIRECT_REFUSAL)
    assert rows["qwen2-tiny/page_first/direct/elastic-per-layer"].expect == "match"     # dense views
    assert rows["qwen2-tiny/page_first/direct/native"].expect == "match"
    assert rows["qwen2-tiny/layer_first/direct/elastic-contiguous"].expect == "match"   # Tensor.copy_
    for layout in ("contiguous", "per-layer"):   # Mamba state is strided in both kvcached layouts
        assert rows[f"qwen3.5-tiny/page_first/direct/elastic-{layout}"].expect == "refused"
    assert not any("direct/pristine" in key for key in rows)   # the pristine failure: kernel io only
    assert "qwen2-tiny/page_first/pristine-contiguous" in rows
    args = matrix.server_args(direct, 30000, matrix.Plan())
    assert args[args.index("--hicache-io-backend") + 1] == "direct"
    assert "--hicache-io-backend" not in matrix.server_args(rows["qwen2-tiny/page_first/native"], 30000,
                                                            matrix.Plan())
    with pytest.raises(ValueError, match="io backends"):
        matrix.build_rows([matrix.CASES["qwen2-tiny"]], io_backends=("dma",))


def test_the_refusal_direct_io_rows_expect_is_what_the_patched_pools_raise(host_modules):
    from tests.support.kvcached_views import mamba_pool, mha_pool

    page = 16
    mha = mha_pool("kvcached-contiguous", size=8 * page, page_size=page, layers=2, heads=2, head_dim=64)
    with pytest.raises(ValueError) as mha_refused:
        host_modules.mha.MHATokenToKVPoolHost(mha, 2.0, 0, page, "page_first_direct", pin_memory=False, device="cpu")
    mamba = mamba_pool("kvcached-per-layer", slots=4, layers=2, conv_shapes=[(96, 3)], temporal_shape=(2, 16, 16),
                       page_bytes=64 << 10)
    with pytest.raises(ValueError) as mamba_refused:
        host_modules.mamba.MambaPoolHost(mamba, 2.0, 0, pin_memory=False, device="cpu", layout="page_first_direct")
    for refused in (mha_refused, mamba_refused):
        assert str(refused.value).startswith(matrix.DIRECT_REFUSAL)


# ---------------------------------------------------------------- responses and logs

def response(ids, tops, host=0, storage=None, device=0):
    details = {"device": device, "host": host}
    if storage is not None:
        details["storage"] = storage
    cached = device + host + (storage or 0)
    return {"output_ids": ids, "meta_info": {
        "output_token_logprobs": [[tops[i][0][1], t, None] for i, t in enumerate(ids)],
        "output_top_logprobs": [[[lp, tok, None] for tok, lp in top] for top in tops],
        "cached_tokens": cached, **({"cached_tokens_details": details} if cached else {})}}


def test_summarize_reads_every_hit_kind():
    tops = [[(5, -0.1)]]
    assert verdict.summarize(response([5], tops, host=448, device=64))["host_tokens"] == 448
    s = verdict.summarize(response([5], tops, storage=448))
    assert (s["device_tokens"], s["host_tokens"], s["storage_tokens"]) == (0, 0, 448)
    cold = verdict.summarize(response([5], tops))
    assert (cold["cached_tokens"], cold["device_tokens"], cold["host_tokens"]) == (0, 0, 0)
    flat = {"meta_info": {"cached_tokens": 64, "output_token_logprobs": [[-0.1, 5, None]],
                          "output_top_logprobs": [[[-0.1, 5, None]]]}}
    assert verdict.summarize(flat)["device_tokens"] == 64 and verdict.summarize(flat)["output_ids"] == [5]


LOG = """\
[2026-11-30 10:00:01] server_args=ServerArgs(model_path='x')
[kvcached][INFO][2026-11-30 10:00:05][patches.py:478] [kvcached] ElasticPagedTokenToKVPoolAllocator in use: size=4096, page_size=64
[kvcached][INFO][2026-11-30 10:00:05][patches.py:843] VirtualKV Cache is allocated (group_id=0). #tokens: 4096, #layers: 4
[2026-11-30 10:00:09] Scheduler hit an exception: Traceback (most recent call last):
  File "/tmp/site/sglang/srt/managers/scheduler.py", line 3, in event_loop
AttributeError: 'ElasticMHATokenToKVPool' object has no attribute 'k_data_ptrs'
[2026-11-30 10:00:09] Received sigquit from a child process. It usually means the child failed.
"""


def test_scan_log_finds_kvcached_and_the_error_line():
    found = verdict.scan_log(LOG)
    assert len(found["kvcached_lines"]) == 2 and "VirtualKV Cache is allocated" in found["kvcached_lines"][1]
    assert found["error"] == "AttributeError: 'ElasticMHATokenToKVPool' object has no attribute 'k_data_ptrs'"
    assert verdict.scan_log("all good\n") == {"kvcached_lines": [], "error": "", "errors": [], "weights_redrawn": []}
    two_ranks = f"x\n{verdict.WEIGHTS_REDRAWN}: 12 tensors (tp rank 0)\n{verdict.WEIGHTS_REDRAWN}: 11 tensors (tp rank 1)\n"
    assert verdict.scan_log(two_ranks)["weights_redrawn"] == [12, 11]
    # the first error line is the cause; a peer's error after it is kept, not shown
    chain = "AttributeError: 'X' object has no attribute 'k_data_ptrs'\nRuntimeError: Connection closed by peer\n"
    assert verdict.scan_log(chain)["error"].startswith("AttributeError")
    assert verdict.scan_log(chain)["errors"][1].startswith("RuntimeError")
    mamba = "[kvcached][INFO][t][patches.py:1609] Elastic MambaPool (group_id=1) #slots=32, layout=contig\n"
    assert verdict.scan_log(mamba)["kvcached_lines"]
    assert verdict.scan_log("AssertionError: Unsupported layout: layer_first\n")["error"].startswith("AssertionError")


# ---------------------------------------------------------------- verdicts

TOPS = [[(5, -0.1), (7, -2.0)], [(9, -0.3), (5, -1.5)]]


def run(host=448, storage=None, kvcached=True, outcome="served", error=""):
    answers = [verdict.summarize(response([5, 9], TOPS, host, storage)), verdict.summarize(response([5, 9], TOPS))]
    return {"outcome": outcome, "error": error, "passes": {"pass1": copy.deepcopy(answers[1:]), "pass2": answers},
            "kvcached_lines": ["VirtualKV Cache is allocated"] if kvcached else []}


def test_identical_runs_match():
    assert verdict.compare(run()["passes"], run()["passes"], 0.0) == []
    assert verdict.verdict("match", run(), run(kvcached=False), 0.0) == ("matches native", [])


def test_every_divergence_is_reported():
    native = run(kvcached=False)["passes"]
    tokens = copy.deepcopy(native)
    tokens["pass2"][0]["output_ids"] = [5, 11]
    assert "pass2 prompt 0: greedy tokens differ from position 1" in verdict.compare(native, tokens, 0.0)
    top = copy.deepcopy(native)
    top["pass2"][1]["top_logprobs"][0] = [(7, -0.1), (5, -0.2)]
    assert "pass2 prompt 1 position 0: top token differs" in verdict.compare(native, top, 0.0)
    swapped = copy.deepcopy(native)
    swapped["pass2"][0]["top_logprobs"][1] = [(9, -0.3), (6, -1.5)]
    assert "pass2 prompt 0 position 1: top-2 token sets differ" in verdict.compare(native, swapped, 0.0)
    drift = copy.deepcopy(native)
    drift["pass2"][0]["top_logprobs"][1] = [(9, -0.3), (5, -1.51)]
    assert any("logprobs differ by 0.01" in p for p in verdict.compare(native, drift, 0.0))
    assert verdict.compare(native, drift, 0.05) == []
    tiny = copy.deepcopy(native)
    tiny["pass1"][0]["top_logprobs"][0] = [(5, -0.1 + 1e-7), (7, -2.0)]
    assert verdict.compare(native, tiny, 0.0) != []          # the default tolerance is bit-identical
    for kind in verdict.HIT_KINDS:
        hits = copy.deepcopy(native)
        hits["pass2"][0][kind] += 64
        assert any(kind.replace("_", " ") in p for p in verdict.compare(native, hits, 0.0)), kind
    short = copy.deepcopy(native)
    short["pass2"].pop()
    assert verdict.compare(native, short, 0.0) == ["pass2: 1 responses, native 2"]


def test_elastic_runs_must_show_kvcached_served():
    result, problems = verdict.verdict("match", run(kvcached=False), run(kvcached=False), 0.0)
    assert result == "matches native" and any("kvcached did not serve" in p for p in problems)
    died = run(outcome="died serving", error="RuntimeError: boom")
    assert verdict.verdict("match", died, run(), 0.0)[1] == ["died serving: RuntimeError: boom"]


def test_pristine_failure_is_recorded_not_an_error():
    native = run(kvcached=False)
    died = run(outcome="died serving", error="AttributeError: no attribute 'k_data_ptrs'")
    assert verdict.verdict("fail", died, native, 0.0) == (
        "fails as expected: AttributeError: no attribute 'k_data_ptrs'", [])
    wrong = run()
    wrong["passes"]["pass2"][0]["output_ids"] = [6, 9]
    result, problems = verdict.verdict("fail", wrong, native, 0.0)
    assert result.startswith("fails as expected (wrong results, no error): pass2 prompt 0") and problems == []
    result, problems = verdict.verdict("fail", run(), native, 0.0)
    assert result == "matches native" and "does not show the failure" in problems[0]
    # same answers from other cache tiers (e.g. the prefix never left the device): not a failure shown
    elsewhere = run()
    elsewhere["passes"]["pass2"][0].update(device_tokens=448, host_tokens=0)
    result, problems = verdict.verdict("fail", elsewhere, native, 0.0)
    assert result.startswith("inconclusive") and "does not show the failure" in problems[0]
    assert "pass2 prompt 0: 448 device tokens, native 0" in problems[0]
    # dying before any backup (out of memory at startup, never ready) shows nothing of it
    for outcome, error in (("died at startup", "RuntimeError: CUDA: out of memory"), ("not ready", "")):
        result, problems = verdict.verdict("fail", run(outcome=outcome, error=error), native, 0.0)
        assert result.startswith(outcome) and "happens at the first backup" in problems[0]
    assert verdict.verdict("match", run(outcome="not ready", error=""), native, 0.0)[0] == \
        "not ready: no error line in its log"


def test_refusals():
    refused = run(outcome="died at startup", error="AssertionError: Unsupported layout: layer_first")
    assert verdict.verdict("refused", refused, None, 0.0, "Unsupported layout") == (
        "refused at startup: AssertionError: Unsupported layout: layer_first", [])
    assert verdict.verdict("refused", run(), None, 0.0, "Unsupported layout")[1]
    other = run(outcome="died at startup", error="RuntimeError: CUDA out of memory")
    assert "expected the refusal" in verdict.verdict("refused", other, None, 0.0, "Unsupported layout")[1][0]


def row_dict(variant, host=448, storage=None, l3=False, kvcached=None, expect="match", **kw):
    r = run(host, storage, kvcached=variant != "native", **kw)
    return {**r, "key": f"c/page_first/{variant}", "group": "c/page_first", "variant": variant, "l3": l3,
            "expect": expect, "case": "c", "pool": "mha", "tp": 1, "kvcached": kvcached, "tree": "patched",
            "host_layout": "page_first", "start_s": 20.0, "run_s": 9.6}


def test_judge_checks_the_oracle_too():
    rows = [row_dict("native"), row_dict("elastic-contiguous", kvcached="contiguous")]
    assert verdict.judge(rows, 0.0) == [] and [r["result"] for r in rows] == ["oracle", "matches native"]
    cold = [row_dict("native", host=0), row_dict("elastic-contiguous", host=0, kvcached="contiguous")]
    assert any("never hit the host cache" in p for p in verdict.judge(cold, 0.0))
    # equal to, or other than, a native run that never reached the tier: no verdict either way
    assert [r["result"] for r in cold] == ["native failed", "no verdict: native failed"]
    cold_other = [row_dict("native", host=0), row_dict("elastic-contiguous", host=448, kvcached="contiguous")]
    verdict.judge(cold_other, 0.0)
    assert cold_other[1]["result"] == "no verdict: native failed" and cold_other[1]["problems"]
    l3 = [row_dict("native", host=0, storage=448, l3=True)]
    assert verdict.judge(l3, 0.0) == []
    l3_cold = [row_dict("native", host=448, storage=0, l3=True)]
    assert any("never hit the L3 store" in p for p in verdict.judge(l3_cold, 0.0))
    polluted = [row_dict("native")]
    polluted[0]["kvcached_lines"] = ["VirtualKV Cache is allocated"]
    assert any("kvcached was not off" in p for p in verdict.judge(polluted, 0.0))
    orphan = [row_dict("elastic-contiguous", kvcached="contiguous")]
    assert verdict.judge(orphan, 0.0) == ["c/page_first/elastic-contiguous: no served native run in this group"]


# ---------------------------------------------------------------- runner

def test_bad_options_are_refused(capsys):
    with pytest.raises(SystemExit):
        e2e.options(["--pool", "all", "--env", "NOEQUALS"])
    assert "KEY=VALUE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.options(["--pool", "all", "--jobs", "0"])
    with pytest.raises(SystemExit, match="pristine-path"):
        servers.check_trees(None, None)


def test_trees_are_checked_with_the_series_status(tmp_path):
    pristine = ROOT / "build" / "sglang-wheel" / "python"
    if not (pristine / "sglang").is_dir():
        pytest.skip("no pristine tree at build/sglang-wheel (make sglang)")
    assert servers.tree_state(str(pristine)).endswith("series pristine")
    with pytest.raises(SystemExit, match="expected 'series applied'"):
        servers.check_trees(str(pristine), str(pristine))


def test_patches_state_tracks_every_listed_patch(tmp_path):
    copy_dir = tmp_path / "patches"
    copy_dir.mkdir()
    for f in (ROOT / "patches").iterdir():
        (copy_dir / f.name).write_bytes(f.read_bytes())
    before = servers.patches_state(copy_dir)
    assert before == servers.patches_state(ROOT / "patches")
    listed = [n for n in before["files"] if n != "series"]
    assert listed and all(n.endswith(".patch") for n in listed)
    last = copy_dir / listed[-1]
    last.write_bytes(last.read_bytes() + b"\n")
    after = servers.patches_state(copy_dir)
    assert after["digest"] != before["digest"] and after["files"][listed[-1]] != before["files"][listed[-1]]
    series = copy_dir / "series"
    series.write_text(series.read_text() + "# a comment changes no patch, but the series file\n")
    assert servers.patches_state(copy_dir)["digest"] != after["digest"]


# A stand-in for `python -m sglang.launch_server`: answers /health_generate and /generate
# like SGLang's server (greedy ids, top logprobs, cache details). A prompt seen before is a
# host hit (a storage hit with --hicache-storage-backend: a file store's folder must exist, a
# Mooncake master must accept its client; FAKE_HANG: /generate never answers); kvcached on
# logs its allocation line. With FAKE_MOONCAKE_DIR a Mooncake client keeps what it stores in
# a file of that folder (its segment) named by its tag, sees what every live client of its
# tag stored, and removes its file when stopped, as a Mooncake client's objects go with its
# segment. The pristine tree with kvcached on dies at its first hit, as 0.5.20 does at the
# first backup; FAKE_SKEW makes kvcached answers differ. Where SGLang's plugin loader would
# find the trained-scale weights plugin (its entry point on the path), it prints that
# plugin's line, as a dummy-weight server does.
FAKE_SERVER = textwrap.dedent('''
    import argparse, glob, importlib.metadata, json, os, signal, socket, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    import sglang
    if os.environ.get("FAKE_IMPORT"):  # as SGLang's DeepSeek and EAGLE paths import deep_gemm
        __import__(os.environ["FAKE_IMPORT"])
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--page-size", type=int)
    ap.add_argument("--hicache-storage-backend")
    ap.add_argument("--hicache-storage-backend-extra-config")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--pp-size", type=int, default=1)
    args, _ = ap.parse_known_args()
    elastic = os.environ["ENABLE_KVCACHED"] == "true"
    store = os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
    if args.hicache_storage_backend == "mooncake":
        config = json.loads(args.hicache_storage_backend_extra_config)
        host, port = config["master_server_address"].rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=5).close()
        print(f"Using Mooncake config prefix: {config['extra_backend_tag']}", flush=True)
    elif args.hicache_storage_backend and not (store and os.path.isdir(store)):
        sys.exit("RuntimeError: no storage directory")
    segments = os.environ.get("FAKE_MOONCAKE_DIR") if args.hicache_storage_backend == "mooncake" else None
    if segments:
        tag = os.path.join(segments, config["extra_backend_tag"])
        segment = f"{tag}.{os.getpid()}"
        open(segment, "w").close()
        signal.signal(signal.SIGTERM, lambda *a: (os.remove(segment), os._exit(0)))
    if elastic:
        print("[kvcached][INFO] VirtualKV Cache is allocated (group_id=0). #tokens: 4096", flush=True)
    plugins = importlib.metadata.entry_points(group="sglang.srt.plugins")
    if any(p.value == "trained_scale_weights:register" for p in plugins):
        for rank in range(args.tp_size * args.pp_size):
            print(f"trained-scale dummy weights drawn: {os.environ.get('FAKE_TENSORS', '42')} tensors", file=sys.stderr,
                  flush=True)
    seen = set()
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path == "/generate":
                body = self.generate(body)
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        do_GET = do_POST
        def generate(self, req):
            if os.environ.get("FAKE_HANG"):
                time.sleep(120)
            ids = req["input_ids"]
            key = json.dumps(ids)
            stored = segments and any(key in open(f).read().splitlines() for f in glob.glob(tag + ".*"))
            hit = (len(ids) - 1) // args.page_size * args.page_size if tuple(ids) in seen or stored else 0
            seen.add(tuple(ids))
            if segments:
                with open(segment, "a") as f:
                    f.write(key + "\\n")
            if hit and elastic and not sglang.PATCHED:
                print("AttributeError: 'ElasticMHATokenToKVPool' object has no attribute 'k_data_ptrs'", flush=True)
                os._exit(1)
            skew = 1 if elastic and os.environ.get("FAKE_SKEW") else 0
            out = [(sum(ids) + i + skew) % 997 for i in range(req["sampling_params"]["max_new_tokens"])]
            tops = [[[-0.25, t, None], [-1.5, t + 1, None]] for t in out]
            kind = "storage" if args.hicache_storage_backend else "host"
            details = {"device": 0, "host": 0, **({"storage": 0} if args.hicache_storage_backend else {})}
            details[kind] = hit
            return {"output_ids": out, "meta_info": {"cached_tokens": hit, "cached_tokens_details": details,
                    "output_token_logprobs": [[-0.25, t, None] for t in out], "output_top_logprobs": tops}}
    HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
''')


@pytest.fixture
def fake_trees(tmp_path, monkeypatch):
    for tree, patched in (("pristine", False), ("patched", True)):
        pkg = tmp_path / tree / "sglang"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(f"PATCHED = {patched}\n")
        (pkg / "launch_server.py").write_text(FAKE_SERVER)
    monkeypatch.setattr(e2e.servers, "check_trees", lambda pristine, patched: {"pristine": "fake", "patched": "fake"})
    monkeypatch.setattr(e2e, "environment", lambda opts: {"fake": True})
    port = servers.free_port_block(jobs=3)
    return ["--launcher", "local", "--pristine-path", str(tmp_path / "pristine"),
            "--patched-path", str(tmp_path / "patched"), "--case", "qwen2-tiny", "--host-layout", "page_first",
            "--jobs", "3", "--port", str(port), "--ready-timeout", "20", "--request-timeout", "30"]


def test_runner_end_to_end_against_a_stand_in_server(fake_trees, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert e2e.main([*fake_trees, "--l3", "also", "--out", str(out), "--env", "EXTRA=1"]) == 0
    report = json.loads(out.read_text())
    rows = {r["key"]: r for r in report["rows"]}
    assert set(rows) == {f"qwen2-tiny/page_first/{v}" for v in
                         ("native", "elastic-contiguous", "elastic-per-layer", "pristine-contiguous")} | {
                        f"qwen2-tiny/page_first/l3/{v}" for v in ("native", "elastic-contiguous", "elastic-per-layer")}
    assert report["problems"] == [] and report["patches"] == servers.patches_state()
    assert rows["qwen2-tiny/page_first/native"]["result"] == "oracle"
    assert rows["qwen2-tiny/page_first/elastic-contiguous"]["result"] == "matches native"
    pristine = rows["qwen2-tiny/page_first/pristine-contiguous"]
    assert pristine["result"].startswith("fails as expected: AttributeError") and pristine["outcome"] == "died serving"
    l3 = rows["qwen2-tiny/page_first/l3/elastic-per-layer"]
    assert verdict.hit_totals(l3)["storage_tokens"] > 0 and verdict.hit_totals(l3)["host_tokens"] == 0
    assert l3["env"]["EXTRA"] == "1" and l3["env"]["KVCACHED_CONTIGUOUS_LAYOUT"] == "false"
    assert all(r["start_s"] is not None and Path(r["log"]).exists() for r in report["rows"])
    assert all(r["dummy"] and r["weights_redrawn"] == [42] for r in report["rows"])
    printed = capsys.readouterr().out
    assert "every row as expected" in printed
    assert e2e.main(["--table", str(out)]) == 0
    table = capsys.readouterr().out
    journal = out.with_suffix(".rows.jsonl")      # rows as they finished: a cut run keeps them
    assert len(journal.read_text().splitlines()) == len(rows)
    assert e2e.main(["--table", str(journal)]) == 0   # the journal renders as the report does
    assert capsys.readouterr().out.count("matches native") == table.count("matches native") > 0


def test_local_servers_import_the_deep_gemm_stand_in_where_the_interpreter_has_none(fake_trees, tmp_path):
    assert servers.lacks(sys.executable, "deep_gemm")
    out = tmp_path / "report.json"
    assert e2e.main([*fake_trees, "--variants", "native", "elastic-contiguous", "--env", "FAKE_IMPORT=deep_gemm",
                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["result"] for r in rows] == ["oracle", "matches native"]


def test_runner_fails_when_kvcached_answers_differ(fake_trees, tmp_path):
    out = tmp_path / "report.json"
    assert e2e.main([*fake_trees, "--variants", "native", "elastic-contiguous", "--env", "FAKE_SKEW=1",
                     "--out", str(out), "--deadline", "600"]) == 1
    problems = json.loads(out.read_text())["problems"]
    assert problems and all(p.startswith("qwen2-tiny/page_first/elastic-contiguous: ") for p in problems)
    assert any("greedy tokens differ" in p for p in problems)


def test_a_row_the_harness_fails_on_is_recorded_and_the_other_rows_are_kept(fake_trees, tmp_path, monkeypatch):
    serve = e2e.Runner.traffic

    def broken(self, server, row, *parts):
        if row.variant.name == "elastic-contiguous":
            raise ImportError("cannot import name 'AutoTokenizer' from 'transformers'")
        return serve(self, server, row, *parts)

    monkeypatch.setattr(e2e.Runner, "traffic", broken)
    out = tmp_path / "report.json"
    assert e2e.main([*fake_trees, "--variants", "native", "elastic-contiguous", "elastic-per-layer",
                     "--out", str(out)]) == 1
    rows = {r["key"]: r for r in json.loads(out.read_text())["rows"]}
    bad = rows["qwen2-tiny/page_first/elastic-contiguous"]
    assert bad["outcome"] == "harness error" and "ImportError: cannot import name 'AutoTokenizer'" in bad["error"]
    assert [Path(p).name for p in bad["logs"]] == ["qwen2-tiny__page_first__elastic-contiguous.log"]
    assert Path(bad["logs"][0]).stat().st_size > 0      # the server ran; what it said is there
    assert rows["qwen2-tiny/page_first/elastic-per-layer"]["result"] == "matches native"
    assert len(out.with_suffix(".rows.jsonl").read_text().splitlines()) == 3


def test_ports_another_run_listens_on_are_not_taken_for_this_runs_servers(fake_trees, tmp_path):
    # a second run given the first's ports: its rows must not be answered by the first's servers
    port = int(fake_trees[fake_trees.index("--port") + 1])
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
        other.listen()
        out = tmp_path / "report.json"
        assert e2e.main([*fake_trees, "--variants", "native", "elastic-contiguous", "--jobs", "1",
                         "--out", str(out)]) == 1
    rows = json.loads(out.read_text())["rows"]
    assert [r["outcome"] for r in rows] == [f"not started: port {port} already has a listener (another server?)"] * 2
    assert all("passes" not in r for r in rows)


def test_without_port_a_run_takes_a_free_block_outside_the_ephemeral_range(fake_trees, tmp_path):
    # the old fixed default, 30000, held by another server: a run that took it would not start
    i = fake_trees.index("--port")
    args = fake_trees[:i] + fake_trees[i + 2:]
    out = tmp_path / "report.json"
    with contextlib.ExitStack() as held:
        other = held.enter_context(socket.socket())
        with contextlib.suppress(OSError):   # already taken by something else: as good
            other.bind(("127.0.0.1", 30000))
            other.listen()
        assert e2e.main([*args, "--variants", "native", "elastic-contiguous", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    ports = [int(r["command"][r["command"].index("--port") + 1]) for r in rows]
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert all(not low <= p <= high for p in ports) and 30000 not in ports


def test_a_report_that_is_not_there_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: .*missing\.json: no such report"):
        e2e.main(["--table", str(tmp_path / "missing.json")])


def test_a_journal_cut_mid_line_by_a_kill_tables_its_whole_rows(tmp_path, capsys):
    lines = gzip.decompress((ROOT / "docs/runs/e2e/2026-12-03-h200-smollm2-graphs-on/report.rows.jsonl.gz")
                            .read_bytes()).decode().splitlines(keepends=True)
    torn = tmp_path / "run.rows.jsonl"
    torn.write_text("".join(lines[:-1]) + lines[-1][:100])
    assert e2e.main(["--table", str(torn)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2 + len(lines) - 1   # head, rule, each whole row
    torn.write_text(lines[0][:100] + "\n" + "".join(lines[1:]))            # not the last line: not a kill
    with pytest.raises(SystemExit, match=r"^error: .*run\.rows\.jsonl: not a report or journal of this tool"):
        e2e.main(["--table", str(torn)])


@pytest.mark.parametrize("name,content", [
    ("bad.json", b"{"), ("binary.json", bytes(range(256))), ("plain.json.gz", b"{}"),
    ("cut.json.gz", gzip.compress(b'{"rows": []}')[:-12]),
    ("corrupt.json.gz", gzip.compress(b"x" * 99)[:10] + b"\xff" * 30),
    ("empty.json", b"{}"), ("list.json", b"[]"), ("rows.json", b'{"rows": [{"key": "a/b/native"}]}'),
    ("bench.json", (ROOT / "bench/results/2026-12-04-h200-bench-server-warm-up/report.json").read_bytes()),
])
def test_a_report_it_cannot_read_or_of_another_tool_is_refused_in_one_line(tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(SystemExit, match=rf"^error: .*{name}: not a report or journal of this tool \(\w+: [^\n]*\)$"):
        e2e.main(["--table", str(tmp_path / name)])


def test_an_out_it_cannot_write_or_flags_it_cannot_split_are_refused_before_any_row(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    (tmp_path / "folder").mkdir()
    for args, message in ((["--out", str(tmp_path / "file" / "r.json")], "cannot make the folder"),
                          (["--out", str(tmp_path / "folder")], "is a folder: name a file"),
                          (["--server-flags", '"x', "--out", str(tmp_path / "r.json")], "No closing quotation")):
        with pytest.raises(SystemExit) as exc:
            e2e.options(["--case", "qwen2-tiny", *args])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    e2e.options(["--case", "qwen2-tiny", "--out", str(tmp_path / "new" / "r.json")])
    assert (tmp_path / "new").is_dir()     # made up front: the rows' journal and logs go beside it


@pytest.fixture
def fake_master(tmp_path, monkeypatch):
    """A stand-in mooncake_master (--mooncake-master) and where each one adds its pid."""
    pid_file = tmp_path / "master.pid"
    monkeypatch.setenv("FAKE_MASTER_PID", str(pid_file))
    return fake_mooncake_master.executable(tmp_path), pid_file


def masters_started(pid_file: Path) -> int:
    """How many stand-in masters served; each must be gone."""
    pids = [int(line) for line in pid_file.read_text().split()]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    return len(pids)


def test_each_mooncake_l3_row_has_a_master_of_its_own_stopped_after_it(fake_trees, fake_master, tmp_path,
                                                                       monkeypatch):
    binary, pid_file = fake_master
    start, started = mooncake_store.MooncakeMaster.start, []

    def one_at_a_time(self):     # --jobs 1: a row's master is gone before the next row's starts
        assert all(m.proc.poll() is not None for m in started), "an earlier row's master still runs"
        started.append(self)
        return start(self)
    monkeypatch.setattr(mooncake_store.MooncakeMaster, "start", one_at_a_time)
    out = tmp_path / "report.json"
    assert e2e.main([*fake_trees, "--l3", "also", "--l3-store", "mooncake", "--mooncake-master", str(binary),
                     "--out", str(out), "--jobs", "1"]) == 0
    report = json.loads(out.read_text())
    l3 = [r for r in report["rows"] if r["l3"]]
    # one that checks the binary serves before any row, then one a row: a store puts an
    # object in any client's segment, and another row's server takes it with it when it stops
    assert report["problems"] == [] and masters_started(pid_file) == 1 + len(l3)
    assert len({r["mooncake_master"] for r in l3}) == len(l3)
    assert all(Path(r["mooncake_master_log"]).name == r["key"].replace("/", "__") + ".mooncake_master.log"
               for r in l3)
    assert report["l3_store"] == {"store": "mooncake", "mooncake_master": str(binary),
                                  "mooncake": mooncake_store.package(sys.executable)}
    assert {r["variant"] for r in l3} == {"native", "elastic-contiguous", "elastic-per-layer"}
    tags = []
    for row in l3:      # each a client of its master (the stand-in exits otherwise), under its own tag
        ns = parse(row["command"][3:])
        assert ns.hicache_storage_backend == "mooncake" and ns.hicache_storage_prefetch_policy == "wait_complete"
        tags.append(json.loads(ns.hicache_storage_backend_extra_config)["extra_backend_tag"])
        assert f"Using Mooncake config prefix: {tags[-1]}" in Path(row["log"]).read_text()
        assert verdict.hit_totals(row)["storage_tokens"] > 0 and verdict.hit_totals(row)["host_tokens"] == 0
        assert row["result"] in ("oracle", "matches native")
    assert len(set(tags)) == len(tags)
    assert all(parse(r["command"][3:]).hicache_storage_backend is None for r in report["rows"] if not r["l3"])
    assert {r["l3_store"] for r in l3} == {"mooncake"}
    assert "| mooncake |" in verdict.markdown_table(report["rows"])


def shared_run(fake_trees, fake_master, tmp_path, monkeypatch, *more):
    segments = tmp_path / "segments"
    segments.mkdir()
    monkeypatch.setenv("FAKE_MOONCAKE_DIR", str(segments))
    out = tmp_path / "report.json"
    code = e2e.main([*fake_trees, "--l3", "only", "--l3-store", "mooncake", "--shared-store", "--mooncake-master",
                     str(fake_master[0]), "--out", str(out), *more])
    report = json.loads(out.read_text())
    assert not list(segments.iterdir())      # every client stopped: its segment went with it
    return code, report, {r["key"]: r for r in report["rows"] if r["shared"]}


def test_a_shared_store_reader_answers_from_what_its_writer_stored(fake_trees, fake_master, tmp_path, monkeypatch):
    code, report, pairs = shared_run(fake_trees, fake_master, tmp_path, monkeypatch)
    assert code == 0 and report["problems"] == []
    assert set(pairs) == {f"qwen2-tiny/page_first/l3-shared/{v}"
                          for v in ("native", "elastic-contiguous", "elastic-per-layer")}
    assert {r["result"] for r in report["rows"] if not r["shared"]} <= {"oracle", "matches native"}
    for key, row in pairs.items():
        assert row["result"] == ("oracle" if key.endswith("native") else "matches native")
        reader = row["reader"]
        writer_flags, reader_flags = parse(row["command"][3:]), parse(reader["command"][3:])
        tag = json.loads(writer_flags.hicache_storage_backend_extra_config)["extra_backend_tag"]
        assert json.loads(reader_flags.hicache_storage_backend_extra_config)["extra_backend_tag"] == tag
        assert row["store_tag"] == reader["store_tag"] == tag
        assert row["mooncake_master"] == reader["mooncake_master"]     # the pair's one store
        if row["kvcached"]:   # both run at once: each its own kvcached instance
            assert row["env"]["KVCACHED_IPC_NAME"] != reader["env"]["KVCACHED_IPC_NAME"]
        assert reader_flags.port != writer_flags.port and row["log"] != reader["log"]
        # the reader never saw pass 1: every hit of its pass 2 came from the store
        assert verdict.hit_totals(row)["storage_tokens"] > 0 and verdict.hit_totals(row)["host_tokens"] == 0
        assert bool(reader["kvcached_lines"]) == (row["kvcached"] is not None) and reader["weights_redrawn"] == [42]
    assert "mooncake (shared: writer, reader)" in verdict.markdown_table(report["rows"])


def test_a_reader_under_another_tag_sees_nothing_and_fails(fake_trees, fake_master, tmp_path, monkeypatch):
    monkeypatch.setattr(e2e.Runner, "store_tag",
                        lambda self, row, role: e2e.matrix.store_tag(row) + ("-other" if role == "reader" else ""))
    code, report, pairs = shared_run(fake_trees, fake_master, tmp_path, monkeypatch, "--variants", "native",
                                     "elastic-contiguous")
    assert code == 1
    assert pairs["qwen2-tiny/page_first/l3-shared/native"]["result"] == "native failed"
    # it equals its native pair, but neither reader saw the store: no verdict, and the problem is its own too
    assert pairs["qwen2-tiny/page_first/l3-shared/elastic-contiguous"]["result"] == "no verdict: native failed"
    reason = "had no storage hit in pass 2: it did not answer from what the writer stored"
    for key in pairs:
        assert any(p.startswith(key + ": the reader (tag ") and "-other" in p and reason in p
                   for p in report["problems"]), report["problems"]
    # the L3 rows that share no store are untouched
    assert all(not p.startswith("qwen2-tiny/page_first/l3/") for p in report["problems"])


def test_a_shared_pairs_reader_must_run_as_its_writer_did():
    pair = {**row_dict("elastic-contiguous", host=0, storage=448, l3=True, kvcached="contiguous"), "shared": True,
            "dummy": True, "weights_redrawn": [42], "store_tag": "t"}
    reader = {"store_tag": "t", "kvcached_lines": ["VirtualKV Cache is allocated"], "weights_redrawn": [42]}
    assert verdict.shared_problems({**pair, "reader": reader}) == []
    assert verdict.shared_problems({**pair, "reader": {**reader, "kvcached_lines": []}}) == [
        "the reader's log has no kvcached allocation, unlike its variant"]
    assert verdict.shared_problems({**pair, "kvcached": None, "reader": reader}) == [
        "the reader's log has kvcached allocations, unlike its variant"]
    assert verdict.shared_problems({**pair, "reader": {**reader, "weights_redrawn": []}}) == [
        "the reader's trained-scale plugin drew [] tensors, the writer [42]"]
    cold = {**row_dict("elastic-contiguous", host=0, storage=0, l3=True, kvcached="contiguous"), "shared": True,
            "store_tag": "t"}
    assert verdict.shared_problems({**cold, "reader": reader}) == [
        "the reader (the same tag) had no storage hit in pass 2: it did not answer from what the writer stored"]
    assert verdict.shared_problems({**cold, "shared": False, "reader": reader}) == []


def test_a_shared_store_needs_mooncake_l3_rows(fake_trees, tmp_path):
    for more in (["--l3", "only"], ["--l3-store", "mooncake"]):
        with pytest.raises(SystemExit, match="--shared-store needs L3 rows on the Mooncake store"):
            e2e.main([*fake_trees, *more, "--shared-store", "--out", str(tmp_path / "r.json")])


def test_a_sigterm_to_the_runner_stops_the_mooncake_master(fake_trees, fake_master, tmp_path, monkeypatch):
    binary, pid_file = fake_master
    returned, at_stop = threading.Event(), []
    stop_all = e2e.Runner.stop_all

    def stop_all_seen(self, *args):   # every master running when it is called is gone when it is done
        running = list(self.masters)
        try:
            stop_all(self, *args)
        finally:
            at_stop.append([m.proc.poll() for m in running])
    monkeypatch.setattr(e2e.Runner, "stop_all", stop_all_seen)

    def terminate():        # once the master serves and the servers take requests that never end
        deadline = time.monotonic() + 20
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2)
        if pid_file.exists() and not returned.is_set():
            os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=terminate, daemon=True).start()
    try:
        with pytest.raises(SystemExit, match="stopped"):
            e2e.main([*fake_trees, "--l3", "only", "--variants", "native", "elastic-contiguous", "--l3-store",
                      "mooncake", "--mooncake-master", str(binary), "--env", "FAKE_HANG=1",
                      "--out", str(tmp_path / "report.json")])
    finally:
        returned.set()
    assert masters_started(pid_file) >= 2     # the check and a row's, both stopped
    assert at_stop and at_stop[0] and None not in at_stop[0], at_stop


def test_a_rows_master_that_does_not_start_fails_that_row_only(fake_trees, fake_master, tmp_path, monkeypatch):
    binary, _ = fake_master
    start = mooncake_store.MooncakeMaster.start

    def contiguous_fails(self):      # the check's and the native row's serve
        if self.log_path.name == "qwen2-tiny__page_first__l3__elastic-contiguous.mooncake_master.log":
            raise mooncake_store.MasterError(f"{binary} exited before serving, 3 times")
        return start(self)
    monkeypatch.setattr(mooncake_store.MooncakeMaster, "start", contiguous_fails)
    out = tmp_path / "report.json"
    assert e2e.main([*fake_trees, "--l3", "only", "--variants", "native", "elastic-contiguous", "--l3-store",
                     "mooncake", "--mooncake-master", str(binary), "--out", str(out)]) == 1
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["native"]["result"] == "oracle"
    assert rows["elastic-contiguous"]["outcome"] == "store failed"
    assert "exited before serving" in rows["elastic-contiguous"]["error"]


def test_a_master_that_does_not_start_stops_the_run_in_one_line(fake_trees, fake_master, tmp_path, monkeypatch):
    binary, _ = fake_master
    monkeypatch.setenv("FAKE_MASTER", "exit")
    with pytest.raises(SystemExit, match="^error: .* exited before serving, 3 times; [^\n]*$"):
        e2e.main([*fake_trees, "--l3", "only", "--l3-store", "mooncake", "--mooncake-master", str(binary),
                  "--out", str(tmp_path / "report.json")])


def test_dummy_weight_servers_must_draw_trained_scale_weights(fake_trees, tmp_path, monkeypatch):
    # without the plugin on their path the servers keep SGLang's 1e-3 weights, whose KV
    # cache moves no logprob: every row then "matches", and the run must fail
    monkeypatch.setattr(e2e.matrix, "PLUGIN", tmp_path / "no-plugin")
    out = tmp_path / "report.json"
    assert e2e.main([*fake_trees, "--variants", "native", "elastic-contiguous", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert [r["result"] for r in report["rows"]] == ["oracle", "matches native"]
    assert len(report["problems"]) == 2 and all("1e-3 scale" in p for p in report["problems"])


def test_every_rank_must_draw_trained_scale_weights_as_native_did():
    native = {"outcome": "served", "tp": 2, "pp": 1, "weights_redrawn": [30, 30]}
    assert verdict.weights_problems(native, native) == []
    for counts in ([30], [30, 0], []):   # a rank without the plugin's line, or that drew nothing
        assert "1e-3 scale" in verdict.weights_problems({**native, "weights_redrawn": counts}, native)[0]
    assert "native [30, 30]" in verdict.weights_problems({**native, "weights_redrawn": [30, 29]}, native)[0]
    assert "not its tensor count" in verdict.weights_problems({**native, "weights_redrawn": True}, native)[0]


def test_a_speculative_draft_draws_its_own_weights_on_every_rank():
    native = {"outcome": "served", "tp": 1, "pp": 1, "models_per_rank": 2, "weights_redrawn": [30, 9]}
    assert verdict.weights_problems(native, native) == []
    problem = verdict.weights_problems({**native, "weights_redrawn": [30]}, native)[0]
    assert "1e-3 scale" in problem and "2 models each" in problem


def test_speculative_decoding_counts_must_equal_natives():
    tops = [[(5, -0.1)]]
    spec = lambda verify, accepted: {"output_ids": [5], "meta_info": {
        "output_token_logprobs": [[-0.1, 5, None]], "output_top_logprobs": [[[-0.1, 5, None]]],
        "cached_tokens": 0, "spec_verify_ct": verify, "spec_accepted_drafts": accepted, "spec_accept_rate": 0.5}}
    native = {"pass2": [verdict.summarize(spec(8, 7))]}
    assert verdict.summarize(spec(8, 7))["spec_verify_ct"] == 8
    assert "spec_accept_rate" not in verdict.summarize(spec(8, 7))   # derived from the two counts
    assert verdict.compare(native, {"pass2": [verdict.summarize(spec(8, 7))]}, 0.0) == []
    assert verdict.compare(native, {"pass2": [verdict.summarize(spec(9, 7))]}, 0.0) == [
        "pass2 prompt 0: spec_verify_ct 9, native 8"]
    assert verdict.compare(native, {"pass2": [verdict.summarize(spec(8, 6))]}, 0.0) == [
        "pass2 prompt 0: spec_accepted_drafts 6, native 7"]
    plain = {"pass2": [verdict.summarize(response([5], tops))]}
    assert verdict.compare(plain, plain, 0.0) == []                   # no speculative decoding: nothing to compare
    assert verdict.compare(native, plain, 0.0) == ["pass2 prompt 0: spec_verify_ct None, native 8",
                                                   "pass2 prompt 0: spec_accepted_drafts None, native 7"]


def test_rows_past_the_deadline_or_without_gpus_are_not_run(fake_trees, tmp_path):
    out = tmp_path / "report.json"
    args = [a for a in fake_trees if a != "qwen2-tiny"]
    args[args.index("--case") + 1:args.index("--case") + 1] = ["qwen2-tiny-tp2"]
    assert e2e.main([*args, "--variants", "native", "--out", str(out), "--gpus", "0"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["outcome"] == "skipped" and row["result"] == "not run: needs 2 GPUs, --gpus names 1"
    assert e2e.main([*fake_trees, "--variants", "native", "--out", str(out), "--deadline", "-1"]) == 0
    assert json.loads(out.read_text())["rows"][0]["result"].startswith("not run: --deadline")
    args[args.index("--case") + 1] = "deepseek-v2-tiny"
    assert e2e.main([*args, "--l3", "only", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["outcome"] == "skipped" and row["result"].startswith("not run: page size 1")


def test_pipeline_stages_take_a_gpu_each(fake_trees, tmp_path):
    out = tmp_path / "report.json"
    args = [a if a != "qwen2-tiny" else "qwen2-tiny-pp2" for a in fake_trees]
    assert e2e.main([*args, "--variants", "native", "--out", str(out), "--gpus", "0"]) == 0
    assert json.loads(out.read_text())["rows"][0]["result"] == "not run: needs 2 GPUs, --gpus names 1"
    assert e2e.main([*args, "--variants", "native", "elastic-contiguous", "--out", str(out), "--gpus", "0,1"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["result"] for r in rows] == ["oracle", "matches native"]
    for row in rows:
        assert len(set(row["gpus"])) == 2 and row["pp"] == 2 and row["tp"] == 1
        assert row["command"][row["command"].index("--pp-size") + 1] == "2"


# The trained-scale weights plugin, loaded by SGLang's own plugin loader from a path entry
# as the servers get it, then SGLang's dummy initialisation called on a small model (a
# linear layer per "layer", 3-D MoE experts, an fp8 weight with its scale, a norm, a bias
# and a buffer), once as rank 0 and once as tensor-parallel rank 1.
PLUGIN_PROBE = textwrap.dedent('''
    import json, sys, torch
    from sglang.srt.plugins import load_plugins
    from sglang.srt.model_loader import loader
    import trained_scale_weights
    load_plugins()
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.Linear(256, 64) for _ in range(2))
    model.experts = torch.nn.Module()
    model.experts.w13_weight = torch.nn.Parameter(torch.zeros(4, 64, 128))
    model.quant = torch.nn.Module()
    model.quant.weight = torch.nn.Parameter(torch.zeros(64, 256, dtype=torch.float8_e4m3fn), requires_grad=False)
    model.quant.weight_scale = torch.nn.Parameter(torch.zeros(1))
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.zeros(256))
    model.register_buffer("cache", torch.zeros(8))
    def draw(rank):
        trained_scale_weights.tensor_parallel_rank = lambda: rank
        with torch.no_grad():
            loader.initialize_dummy_weights(model)
        return {k: v.clone().float() for k, v in model.state_dict().items()}
    first, again, rank1 = draw(0), draw(0), draw(1)
    w = [first["layers.0.weight"], first["layers.1.weight"], first["experts.w13_weight"], first["quant.weight"]]
    print(json.dumps({
        "max_abs": [t.abs().max().item() for t in w], "std": [t.std().item() for t in w],
        "layers_differ": not torch.equal(w[0], w[1]), "repeatable": all(torch.equal(first[k], again[k]) for k in first),
        "ranks_differ": [k for k in first if not torch.equal(first[k], rank1[k])],
        "ones": {k: first[k].unique().tolist() for k in ("norm.weight", "quant.weight_scale")},
        "bias_max": first["layers.0.bias"].abs().max().item(), "cache_max": first["cache"].abs().max().item()}))
''')


def test_trained_scale_plugin_redraws_sglangs_dummy_weights():
    import sglang

    tree = os.path.dirname(os.path.dirname(os.path.abspath(sglang.__file__)))
    done = subprocess.run([sys.executable, "-c", PLUGIN_PROBE], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([tree, str(matrix.PLUGIN)]),
                               "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # one line per draw, with its count: 2 linear + experts + fp8 weight + its scale + norm
    assert verdict.scan_log(done.stderr)["weights_redrawn"] == [6, 6, 6]
    # unit-variance outputs: U(-b, b), b = sqrt(3 / fan_in), fan_in the last dimension
    for bound, top, std in zip([math.sqrt(3 / 256)] * 2 + [math.sqrt(3 / 128), math.sqrt(3 / 256)],
                               got["max_abs"], got["std"]):
        assert bound * 0.9 < top <= bound * 1.07   # fp8 rounds up to about 6 %
        assert abs(std - bound / math.sqrt(3)) < 0.08 * bound
    assert got["layers_differ"] and got["repeatable"] and got["ones"] == {"norm.weight": [1.0],
                                                                       "quant.weight_scale": [1.0]}
    # another tensor-parallel rank holds other values of every drawn matrix
    assert sorted(got["ranks_differ"]) == ["experts.w13_weight", "layers.0.weight", "layers.1.weight", "quant.weight"]
    # what the plugin leaves alone keeps SGLang's U(-1e-3, 1e-3) values
    assert got["bias_max"] <= 1e-3 and got["cache_max"] <= 1e-3


def test_docker_servers_of_dummy_cases_get_the_plugin(tmp_path, monkeypatch):
    # the container sees the plugin folder (read-only) and has it on its PYTHONPATH
    started = []

    class Exited:
        pid, returncode = 0, 1

        def __init__(self, command, **kwargs):
            started.append(command)

        def poll(self):
            return 1

    monkeypatch.setattr(servers.subprocess, "Popen", Exited)
    monkeypatch.setattr(servers.Server, "stop", lambda self, grace=30: None)
    opts = e2e.options(["--launcher", "docker", "--case", "qwen2-tiny", "--out", str(tmp_path / "r.json"),
                        "--ready-timeout", "1"])
    runner = e2e.Runner(opts, matrix.Plan())
    row = matrix.build_rows([matrix.CASES["qwen2-tiny"]], ["page_first"], ["native"])[0]
    result = runner.serve(row, 0)
    (command,) = started
    plugin = str(matrix.PLUGIN)
    assert result["outcome"] == "died at startup" and result["env"]["PYTHONPATH"] == plugin
    assert f"{plugin}:{plugin}:ro" in command and f"PYTHONPATH={plugin}" in command
    # a name of its own, so that a stop can remove a container its killed client left
    assert command[command.index("--name") + 1].startswith(f"sglang-e2e-{command[command.index('--port') + 1]}-")


def test_a_draft_cases_native_must_show_speculative_decoding_ran():
    """Equal speculative counts on both sides prove nothing when neither side decoded
    speculatively (the counts are absent from every answer)."""
    plain = [{**row_dict("native"), "draft": "packed"}]
    assert any("no speculative decoding" in p for p in verdict.judge(plain, 0.0))
    spec = [{**row_dict("native"), "draft": "packed"}]
    for answers in spec[0]["passes"].values():
        for a in answers:
            a.update(spec_verify_ct=4, spec_accepted_drafts=1)
    assert verdict.judge(spec, 0.0) == []
    assert verdict.judge([row_dict("native")], 0.0) == []          # no draft: nothing asked


def test_direct_io_rows_leave_l3_on_kernel_io_and_run_after_the_default_groups():
    rows = matrix.build_rows([matrix.CASES["qwen2-tiny"]], ["page_first"], l3="also", io_backends=("kernel", "direct"))
    assert {r.io_backend for r in rows if r.l3} == {"kernel"}
    assert {r.io_backend for r in rows if not r.l3} == {"kernel", "direct"}
    order = [rows[i] for i in matrix.run_order(rows)]
    kinds = ["direct" if r.io_backend == "direct" else "l3" if r.l3 else "default" for r in order]
    assert kinds == sorted(kinds, key=["default", "l3", "direct"].index)   # default groups, L3, then direct


def test_a_draft_rows_record_says_two_models_per_rank(tmp_path):
    opts = e2e.options(["--case", "mimo-tiny-mtp", "--out", str(tmp_path / "r.json")])
    runner = e2e.Runner(opts, matrix.Plan())
    draft_row, plain_row = (matrix.build_rows([matrix.CASES[n]], ["page_first"], ["native"])[0]
                            for n in ("mimo-tiny-mtp", "qwen2-tiny"))
    assert (runner.record(draft_row)["models_per_rank"], runner.record(draft_row)["draft"]) == (2, "packed")
    assert (runner.record(plain_row)["models_per_rank"], runner.record(plain_row)["draft"]) == (1, "")
