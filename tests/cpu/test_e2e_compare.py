"""ci/e2e/compare_servers.py: its server flags, launch commands and comparison.

The script itself needs GPUs and model servers (not run here); what it decides is
checked here: every flag it passes parses with SGLang 0.5.20's own argument parser
into the intended settings, native and patched runs differ only in kvcached's
environment, the passes can actually produce host hits, and the comparison flags
every kind of divergence while accepting identical runs.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.project_files
spec = importlib.util.spec_from_file_location("compare_servers", ROOT / "ci" / "e2e" / "compare_servers.py")
e2e = importlib.util.module_from_spec(spec)
sys.modules["compare_servers"] = e2e
spec.loader.exec_module(e2e)


def parse(args):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(args)


@pytest.mark.parametrize("layout", sorted(e2e.LAYOUTS))
@pytest.mark.parametrize("name", sorted(e2e.CASES))
def test_server_flags_parse_with_sglangs_parser(name, layout):
    case, plan = e2e.CASES[name], e2e.Plan()
    ns = parse(e2e.server_args(case, layout, 30000, plan))
    assert ns.enable_hierarchical_cache is True
    assert ns.hicache_mem_layout == ("layer_first" if layout == "layer_first" else "page_first")
    assert ns.hicache_io_backend == "kernel" and ns.hicache_write_policy == "write_through"  # SGLang's defaults
    assert ns.tp_size == case.tp and ns.page_size == plan.page_size
    assert ns.max_total_tokens == plan.device_tokens and ns.skip_tokenizer_init is True
    assert (ns.load_format == "dummy") == case.dummy


def test_native_and_patched_differ_only_in_kvcached_env():
    case = e2e.CASES["qwen3.5-4b"]
    assert e2e.server_env(case, patched=False) == {"ENABLE_KVCACHED": "false"}
    assert e2e.server_env(case, patched=True) == {
        "ENABLE_KVCACHED": "true", "KVCACHED_MAX_CACHED_TOKENS": "-1", "KVCACHED_PAGE_SIZE_MB": "4"}
    assert "KVCACHED_PAGE_SIZE_MB" not in e2e.server_env(e2e.CASES["qwen2.5-7b"], patched=True)


def test_launch_commands():
    args = ["--model-path", "m"]
    docker = e2e.launch_command("docker", "img:tag", {"ENABLE_KVCACHED": "true"}, args, "0,1")
    assert docker[:2] == ["docker", "run"] and '"device=0,1"' in docker
    assert docker[docker.index("img:tag") + 1:] == ["python3", "-m", "sglang.launch_server", *args]
    assert docker[docker.index("ENABLE_KVCACHED=true") - 1] == "-e"
    local = e2e.launch_command("local", None, {"ENABLE_KVCACHED": "false"}, args, "0")
    assert local == ["env", "ENABLE_KVCACHED=false", "python3", "-m", "sglang.launch_server", *args]
    with pytest.raises(ValueError):
        e2e.launch_command("docker", None, {}, args, "0")


def test_passes_overflow_the_device_but_not_the_host():
    plan = e2e.Plan()
    prompts, filler = e2e.prompt_sets(plan, 1024)
    prompt_tokens = sum(map(len, prompts))
    filler_tokens = sum(map(len, filler))
    assert filler_tokens > plan.device_tokens >= prompt_tokens
    assert plan.hicache_ratio * plan.device_tokens >= prompt_tokens + filler_tokens
    assert len({tuple(p[:8]) for p in prompts + filler}) == len(prompts) + len(filler)  # no shared prefixes
    assert e2e.prompt_sets(plan, 1024) == (prompts, filler)  # fixed: both servers see the same ids


def test_dummy_config_is_a_valid_model_config():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(e2e.CASES["tiny-dummy"].model)
    head_dim = config.hidden_size // config.num_attention_heads
    assert config.model_type == "qwen2"
    assert (config.num_key_value_heads * head_dim * 2) % 128 == 0  # a row the JIT HiCache kernel takes


def response(ids, tops, host):
    return {"output_ids": ids, "meta_info": {
        "output_token_logprobs": [[tops[i][0][1], t, None] for i, t in enumerate(ids)],
        "output_top_logprobs": [[[lp, tok, None] for tok, lp in top] for top in tops],
        "cached_tokens": 512, "cached_tokens_details": {"device": 512 - host, "host": host}}}


@pytest.fixture
def native():
    tops = [[(5, -0.1), (7, -2.0)], [(9, -0.3), (5, -1.5)]]
    return [e2e.summarize(response([5, 9], tops, 448)), e2e.summarize(response([5, 9], tops, 0))]


def test_identical_runs_match(native):
    assert e2e.summarize(response([5, 9], [[(5, -0.1)], [(9, -0.3)]], 448))["host_tokens"] == 448
    assert e2e.compare(native, copy.deepcopy(native), 1e-3) == []


def test_divergences_are_reported(native):
    tokens = copy.deepcopy(native)
    tokens[0]["output_ids"] = [5, 11]
    assert "prompt 0: greedy tokens differ from position 1" in e2e.compare(native, tokens, 1e-3)
    top = copy.deepcopy(native)
    top[1]["top_logprobs"][0] = [(7, -0.1), (5, -0.2)]
    assert "prompt 1 position 0: top token differs" in e2e.compare(native, top, 1e-3)
    drift = copy.deepcopy(native)
    drift[0]["top_logprobs"][1] = [(9, -0.3), (5, -1.51)]
    assert any("logprobs differ by 0.0100" in p for p in e2e.compare(native, drift, 1e-3))
    assert e2e.compare(native, drift, 0.05) == []
    hits = copy.deepcopy(native)
    hits[0]["host_tokens"] = 0
    assert "prompt 0: 0 host-hit tokens, native 448" in e2e.compare(native, hits, 1e-3)
    assert e2e.compare(native, native[:1], 1e-3) == ["2 native responses vs 1 patched"]


def test_no_host_hits_at_all_is_a_failed_run(native):
    cold = copy.deepcopy(native)
    for r in cold:
        r["host_tokens"] = 0
    assert any("never hit the host cache" in p for p in e2e.compare(cold, copy.deepcopy(cold), 1e-3))
