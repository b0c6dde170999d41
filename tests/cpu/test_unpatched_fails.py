"""The CPU tier's checks fail on SGLang 0.5.20 without the series.

Runs the cases the series fixes (round trips, split, refusals, controller, kernel wrappers
and geometry, packed MTP drafts) in a subprocess against the pristine tree
($PRISTINE_SGLANG) and asserts that they fail there, so none of those tests could pass
whatever the code did, while the same tests over dense pools pass there.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRISTINE = os.environ.get("PRISTINE_SGLANG")


# Cases the series fixes: each must fail on the pristine tree.
EXPECTED_TO_FAIL = [
    "test_kv_roundtrip.py::test_mha[kvcached-contiguous-layer_first-kernel-64-bf16]",
    "test_kv_roundtrip.py::test_mha[kvcached-contiguous-page_first-kernel-16-fp8]",
    "test_kv_roundtrip.py::test_mla[kvcached-contiguous-layer_first-kernel-1-bf16]",
    "test_kv_roundtrip.py::test_mla[kvcached-contiguous-page_first-kernel-64-bf16]",
    "test_mamba_roundtrip.py::test_host_pool_sees_the_model_geometry[kvcached-per-layer]",
    "test_mamba_roundtrip.py::test_round_trips[kvcached-contiguous-page_first-kernel]",
    "test_hicache_split.py::test_qwen35_mamba_split_equals_native[kvcached-contiguous]",
    "test_hicache_split.py::test_swa_split_equals_native[kvcached-per-layer]",
    "test_refusals.py::test_mha_page_head",
    "test_refusals.py::test_mla_decode_context_parallel_is_served[0-layer_first]",
    "test_refusals.py::test_page_first_direct[mha]",
    "test_refusals.py::test_mamba_page_first_direct",
    "test_mtp_drafts.py::test_mha_packed_drafts[kvcached-contiguous-kvcached-contiguous-page_first-kernel-1-1]",
    "test_mtp_drafts.py::test_mla_packed_drafts[kvcached-contiguous-native-layer_first-kernel-2-16]",
    "test_mtp_drafts.py::test_page_first_without_the_staged_write_back[mla]",
    "test_controller.py::test_defaults_back_up_and_load_through_the_controller[MHA-kvcached-contiguous]",
    "test_controller.py::test_defaults_back_up_and_load_through_the_controller[MLA-kvcached-contiguous]",
    "test_controller.py::test_defaults_back_up_and_load_through_the_controller[hybrid-kvcached-contiguous]",
    "test_controller.py::test_defaults_back_up_and_load_through_the_controller[hybrid-kvcached-per-layer]",
    "test_controller.py::test_unserved_layouts_are_refused_when_the_stack_is_built[MHA-flags0]",
    "test_controller.py::test_unserved_layouts_are_refused_when_the_stack_is_built[hybrid-flags4]",
    "test_controller.py::test_host_pools_are_sized_as_natively_through_the_builder[kvcached-contiguous-hicache-size]",
    "test_kernel_wrappers.py::test_staged_write_back_reads_the_device_stride[strided-MHA]",
    "test_kernel_wrappers.py::test_staged_write_back_reads_the_device_stride[strided-MLA]",
    "test_kernel_wrappers.py::test_mamba_wrappers_step_device_slots_by_their_stride[strided]",
    "test_strided_views.py::test_each_stride_gets_its_own_run_and_equal_strides_merge",
    "test_hicache_split.py::test_qwen35_mamba_host_pool_gets_the_slots_native_gives",
    "upstream/test_mem_pool_host.py::TestMHAHostPoolStridedDeviceRows::test_strided_rows_round_trip",
    "upstream/test_mem_pool_host.py::TestMLAHostPoolStridedDeviceRows::test_host_layouts_without_a_strided_copy_are_refused",
    "upstream/test_asymmetric_mha_pool_host_unit.py::TestAsymmetricMHAHostPoolStridedDeviceViews::test_strided_device_views_are_refused_before_allocation",
    "upstream/test_mem_pool_host.py::TestMHAHostPoolStridedDeviceRows::test_a_pool_without_pointer_tables_round_trips",
    "upstream/test_mem_pool_host.py::TestMHAHostPoolStridedDeviceRows::test_draft_layers_of_one_stride_are_backed_up_in_one_launch",
    "upstream/test_hicache_staged_write_back.py::TestStagedWriteBackStridedDeviceRows::test_mla_rows_are_read_by_their_stride",
    "upstream/test_mem_pool_host.py::TestMambaHostPoolStridedDeviceSlots::test_strided_slots_round_trip",
    "upstream/test_mem_pool_host.py::TestMambaHostPoolPerLayerDeviceState::test_layers_allocated_apart_round_trip",
    "upstream/test_hybrid_pool_assembler.py::TestSplitHicacheSizeByServedKV::test_reserved_rows_take_no_share",
]
# Native pools (dense views) are served the same with or without the series.
DENSE_CONTROLS = [
    "test_kv_roundtrip.py::test_mha[native-layer_first-kernel-16-bf16]",
    "test_mtp_drafts.py::test_mha_packed_drafts[native-native-page_first-kernel-1-1]",
    "test_controller.py::test_defaults_back_up_and_load_through_the_controller[hybrid-native]",
    "test_kernel_wrappers.py::test_staged_write_back_reads_the_device_stride[dense-MHA]",
    "test_kernel_wrappers.py::test_mamba_wrappers_step_device_slots_by_their_stride[dense]",
    "upstream/test_mem_pool_host.py::TestMLAHostPoolStridedDeviceRows::test_packed_rows_round_trip",
    "upstream/test_mem_pool_host.py::TestMambaHostPoolStridedDeviceSlots::test_packed_slots_round_trip",
    "upstream/test_hybrid_pool_assembler.py::TestSplitHicacheSizeByServedKV::test_pools_reporting_only_their_buffer_bytes",
]


def node(case: str) -> str:
    """A case's pytest node id: upstream/... under tests/, the rest under tests/cpu/."""
    return f"tests/{case}" if case.startswith("upstream/") else f"tests/cpu/{case}"


@pytest.mark.skipif(not PRISTINE, reason="set by `make test`: the pristine tree's python/ folder")
def test_fixed_cases_fail_on_the_pristine_tree():
    cases = [node(case) for case in EXPECTED_TO_FAIL + DENSE_CONTROLS]
    env = dict(os.environ, PYTHONPATH=f"{PRISTINE}:{ROOT}")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", *cases],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    outcome = {}
    for line in proc.stdout.splitlines():
        # A unittest subTest that fails reports SUBFAILED(...) after its test's PASSED line.
        status = re.match(r"(FAILED|PASSED|ERROR|SUBFAILED)\S* .*?(tests/\S+)", line)
        if status and outcome.get(status[2]) != "FAILED":
            outcome[status[2]] = status[1].removeprefix("SUB")
    missing = [case for case in EXPECTED_TO_FAIL if outcome.get(node(case)) != "FAILED"]
    assert not missing, f"expected to fail on the pristine tree but did not: {missing}\n{proc.stdout[-3000:]}"
    not_served = [case for case in DENSE_CONTROLS if outcome.get(node(case)) != "PASSED"]
    assert not not_served, f"dense pools must pass on the pristine tree too: {not_served}\n{proc.stdout[-3000:]}"
