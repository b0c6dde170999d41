"""The series changes nothing for SGLang's own pools: pristine 0.5.20 is the oracle.

harness/differential/runner.py runs every case (every host-pool class and builder of
SGLang 0.5.20, crossed with every host layout and io backend its parser accepts, over
SGLang's own dense device pools with real models' shapes) in one process per tree, side
by side: the pristine tree ($PRISTINE_SGLANG) and the tree under test (the `sglang` on
PYTHONPATH, the patched one under `make test`). Outcomes must be identical: the same
exception where pristine refuses, the same sizes, the same bytes in every host and device
buffer after every step. Kernels are emulated below SGLang's Python wrappers
(harness/emulation/__init__.py). What is covered and how to run the same cases on a GPU
with the real kernels: docs/differential.md.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest

from harness.differential import compare, inventory, pair

PRISTINE = os.environ.get("PRISTINE_SGLANG")

# What needs no case, and why; everything else SGLang 0.5.20 defines must have one.
# (Every host-pool class and builder of 0.5.20 builds on CPU tensors, the NPU MLA pool
# included: nothing is left out for want of an accelerator.)
NO_CASE = {"register_stack_strategy": "registers a strategy object for forks of SGLang; builds no pool"}

# Scenarios SGLang 0.5.20 itself refuses in every layout: they compare its refusals
# only. The test fails the day one of them builds, so that it is compared in full.
_KONLY = ("MHATokenToKOnlyPoolHost never sets can_use_write_back_jit, which HostPoolGroup reads "
          "from every entry: AttributeError when the group is built")
REFUSED_BY_PRISTINE = {"minimax-sparse/index-k": _KONLY, "minimax-sparse-hiradix/index-k": _KONLY}


@pytest.fixture(scope="module")
def outcomes():
    if not PRISTINE:
        pytest.skip("set by `make test`: PRISTINE_SGLANG, the pristine tree's python/ folder")
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin, "no sglang on PYTHONPATH"
    trees = {"pristine": Path(PRISTINE).resolve(), "patched": Path(spec.origin).parent.parent.resolve()}
    with tempfile.TemporaryDirectory() as out:
        documents = pair.run_pair(trees, Path(out))
    return documents["pristine"], documents["patched"]


def test_the_pair_compares_a_pristine_tree_with_a_patched_one(outcomes):
    pristine, patched = outcomes
    assert pristine["series"].endswith(": series pristine"), pristine["series"]
    assert patched["series"].endswith(": series applied"), patched["series"]


def test_the_pair_refuses_a_folder_that_holds_no_sglang(tmp_path):
    with pytest.raises(RuntimeError, match="did not say what the tree holds: .*not an SGLang tree"):
        pair.series_state(tmp_path)


def test_every_case_is_identical_on_both_trees(outcomes):
    pristine, patched = outcomes
    assert pristine["choices"] == patched["choices"], "the trees' parsers accept different layouts or io backends"
    differences = compare.compare(pristine, patched)
    assert not differences.first, compare.report(differences)


def test_every_host_pool_class_and_builder_has_a_case(outcomes):
    pristine, _ = outcomes
    wanted = set(inventory.host_pool_classes(Path(PRISTINE))) | set(inventory.assembler_builders(Path(PRISTINE)))
    reached = {name for case in pristine["cases"] for name in case["reached"]}
    missing = wanted - reached - set(NO_CASE)
    assert not missing, f"SGLang 0.5.20 defines these, and no differential case reaches them: {sorted(missing)}"
    stale = set(NO_CASE) - wanted
    assert not stale, f"allowed to have no case, but no longer in the tree: {sorted(stale)}"


def test_every_scenario_crosses_every_layout_and_io_backend(outcomes):
    pristine, _ = outcomes
    choices, defaults = pristine["choices"], pristine["defaults"]
    every = {f"{layout}+{io}" for layout in choices["hicache_mem_layout"] for io in choices["hicache_io_backend"]}
    by_scenario = {}
    for case in pristine["cases"]:
        scenario, combination = case["id"].rsplit("/", 1)
        by_scenario.setdefault(scenario, []).append((combination, case))
    for scenario, cases in by_scenario.items():
        want = ({f"{defaults['hicache_mem_layout']}+{defaults['hicache_io_backend']}"}
                if scenario in pristine["flag_variants"] else every)
        assert {combination for combination, _ in cases} == want, f"{scenario}: not every layout and io backend"
        # A scenario SGLang never builds would compare nothing but refusals.
        builds = any(step["step"] == "final" for _, case in cases for step in case["steps"])
        assert builds != (scenario in REFUSED_BY_PRISTINE), (
            f"{scenario}: {'builds' if builds else 'never builds'} on SGLang 0.5.20")


def test_long_trips_back_up_more_than_one_staging_chunk(outcomes):
    # the page_first write-back stages 64 pages a launch: these cases take several
    from sglang.srt.mem_cache.pool_host.base import _WRITE_BACK_STAGING_PAGE_CHUNK
    from harness.differential.scenarios import PAGE

    pristine, _ = outcomes
    staged = [case for case in pristine["cases"] if "-long-trips/" in case["id"] and
              case["id"].endswith("/page_first+kernel")]
    assert len(staged) == 2, [case["id"] for case in staged]
    for case in staged:
        writes = [step for step in case["steps"] if step["step"].endswith(".write")]
        assert writes and all("error" not in step for step in writes), case["id"]
        assert all(len(step["result"]["host"]) > _WRITE_BACK_STAGING_PAGE_CHUNK * PAGE for step in writes), case["id"]


# The comparison itself, on small outcome documents: each kind of difference is found.
def _document(**case):
    base = {"id": "s/page_first+kernel", "steps": [
        {"step": "construct", "result": {"entries": 1},
         "state": {"hashes": {"kv.host.kv_buffer": "aa"}, "scalars": {"kv.host.size": 272}}},
        {"step": "trip1.write", "state": {"hashes": {"kv.host.kv_buffer": "bb"}}}], "reached": ["X"], "debug": {}}
    base.update(case)
    return {"choices": {}, "cases": [base]}


def _mutated(change):
    document = _document()
    change(document["cases"][0])
    return document


@pytest.mark.parametrize("change, found", [
    (lambda c: c["steps"][1]["state"]["hashes"].update({"kv.host.kv_buffer": "cc"}), "hashes.kv.host.kv_buffer"),
    (lambda c: c["steps"][0]["state"]["scalars"].update({"kv.host.size": 288}), "scalars.kv.host.size"),
    (lambda c: c["steps"][1].update(error={"type": "ValueError", "message": "no"}), "patched raises"),
    (lambda c: c["steps"].pop(), "steps[1]"),
    (lambda c: c["steps"][0]["state"]["hashes"].pop("kv.host.kv_buffer"), "(absent)"),
    (lambda c: c["reached"].append("Y"), "reached[1]"),
], ids=["bytes", "size", "new-exception", "missing-step", "missing-buffer", "reached"])
def test_comparison_finds_each_kind_of_difference(change, found):
    differences = compare.compare(_document(), _mutated(change))
    assert len(differences.first) == 1 and found in differences.first[0], differences.first


@pytest.mark.parametrize("message", [
    "illegal memory access: dst_k + 589824 (65536 bytes) lies outside its allocation",
    "layer 3: null pointer in a kernel pointer table",
    "transfer_kv_launcher: no indices (integer division by zero in the launcher)"])
def test_comparison_fails_what_would_fault_on_a_gpu_even_on_both_trees(message):
    # on a GPU the same copy corrupts memory or kills the process: the case proves nothing
    fault = {"type": "KernelError", "message": message}
    both = [_mutated(lambda c: c["steps"][1].update(error=fault)) for _ in range(2)]
    differences = compare.compare(*both)
    assert len(differences.first) == 1 and "pristine would fault on a GPU" in differences.first[0]
    other = {"type": "ValueError", "message": "Unsupported layout: page_head"}   # a refusal: compared
    assert not compare.compare(*[_mutated(lambda c: c["steps"][1].update(error=other)) for _ in range(2)]).first


def test_comparison_lists_what_only_the_patched_tree_adds_without_failing():
    document = _mutated(lambda c: c["steps"][0]["state"]["scalars"].update({"kv.host.stride": 1}))
    differences = compare.compare(_document(), document)
    assert not differences.first and differences.added == {"scalars.kv.host.stride"}
    assert not compare.compare(_document(), _document()).first


def test_gpu_runner_unregisters_what_a_case_left_pinned(monkeypatch):
    # --real-kernels notes every buffer SGLang pins and unregisters, after each case,
    # what no destroy() released (a host pool whose constructor raised after pinning)
    import torch
    from sglang.srt.mem_cache.pool_host import common

    from harness.differential import kernels

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(common, "_cuda_host_register", lambda buffer, *a, **k: calls.append(("register", buffer)))
    monkeypatch.setattr(common, "_cuda_host_unregister", lambda buffer: calls.append(("unregister", buffer)))
    monkeypatch.setattr(kernels, "_registered", [])
    # An installed sgl_kernel would ask the (faked) device for its architecture on import.
    monkeypatch.setitem(sys.modules, "sgl_kernel", None)
    assert kernels.real() == "sgl_kernel: not installed"
    left, released = torch.zeros(4), torch.zeros(8)
    common._cuda_host_register(left)
    common._cuda_host_register(released)
    kernels.release_host_memory()
    assert calls == [("register", left), ("register", released), "synchronize",
                     ("unregister", released), ("unregister", left)]
    kernels.release_host_memory()   # nothing left: no second unregister
    assert len(calls) == 5
