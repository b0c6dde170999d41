"""GPU tier: real kvcached 0.1.6 elastic pools, real SGLang host pools, real JIT kernels.

kvcached reads KVCACHED_CONTIGUOUS_LAYOUT when it is imported, so one pytest process
covers one kvcached layout; `make test-gpu` runs the tier once per layout. Each test
appends one JSON line (configuration, trips, result) to $GPU_RESULTS for the table in
docs/harness.md and results/.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from harness.project import patches_state

os.environ.setdefault("ENABLE_KVCACHED", "true")
os.environ.setdefault("KVCACHED_AUTOPATCH", "1")
# KVCACHED_PAGE_SIZE_MB is set per run by run_tier.sh (GDN cells need 4 MiB pages).

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("the GPU tier needs a CUDA device", allow_module_level=True)

import kvcached.integration.sglang.autopatch  # noqa: E402,F401  (before sglang)
import sglang  # noqa: E402,F401
import sglang.srt.distributed as _dist  # noqa: E402

# Outside a server the TP getters assert; kvcached's pools call them.
_dist.get_tensor_model_parallel_rank = lambda: 0
_dist.get_tensor_model_parallel_world_size = lambda: 1
_dist.get_pipeline_model_parallel_rank = lambda: 0

import kvcached.utils as _kvc_utils  # noqa: E402

LAYOUT = "contiguous" if _kvc_utils.CONTIGUOUS_LAYOUT else "per-layer"
TRIPS = int(os.environ.get("GPU_TRIPS", "1000"))


def record(**row):
    # The series these rows are of: its digest, as `harness.results add gpu-tier` groups rows.
    series = patches_state()
    row.update(kvcached_layout=LAYOUT, gpu=torch.cuda.get_device_name(), time=time.strftime("%Y-%m-%dT%H:%M:%S"),
               series=f"0001-{len(series['files']) - 1:04d} {series['digest'][:16]}")
    path = os.environ.get("GPU_RESULTS")
    if path:
        with open(path, "a") as handle:
            handle.write(json.dumps(row) + "\n")


@pytest.fixture
def trips():
    return TRIPS


@pytest.fixture(autouse=True)
def release_kvcached():
    """After each test: stop its kvcached pools and release kvcached's device mappings.

    kvcached 0.1.6 gives every pool virtual ranges as large as the GPU's memory (all its
    layers and K/V buffers together), maps its zero page over all of them
    (integration/sglang/interfaces.py: alloc_kv_cache; csrc/ftensor.cpp: init_with_zero_)
    and keeps a pool's tensors until shutdown_kvcached, whether the pool is still used or
    not. In one process of the per-layer layout the eighth such pool failed to map
    ("physical page access setup failed in CUDA: out of memory"). The next pool
    initialises kvcached again (its elastic pools call init_kvcached when it is not).
    A pool whose manager does not stop keeps kvcached up (its threads may still map
    pages): the teardown fails, naming it.
    """
    yield
    import gc

    import kvcached.integration.sglang.interfaces as kvi
    from kvcached.pool_registry import get_registered_kv_cache_pools

    gc.collect()
    torch.cuda.synchronize()
    managers = [manager for manager, _ in get_registered_kv_cache_pools(integration="sglang")]
    running = [manager for manager in managers if not manager.shutdown()]
    assert not running, f"kvcached pools did not stop: {running}; kvcached left up"
    assert kvi.shutdown_kvcached(), "kvcached did not shut down"
