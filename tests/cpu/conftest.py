"""CPU tier: the real SGLang host-pool classes of the tree on PYTHONPATH (the patched
one under `make test`), over device pools with kvcached's geometry, with only the
compiled kernels emulated (harness/emulation/__init__.py): SGLang's Python kernel
wrappers and JIT gates run as they are."""
from types import SimpleNamespace

import pytest

from harness.emulation import install_kernel_emulation


# SGLang warns at import that its AWQ and GGUF kernels need a GPU ("Only CUDA, HIP and
# XPU support AWQ currently.", "Only CUDA, MUSA and NPU support GGUF ..."): on this CPU
# tier that is expected, so they are kept out of pytest's warnings summary, as `make`'s
# import check keeps them out of its output. Every other warning is shown.
GPU_ONLY_WARNINGS = "ignore:Only CUDA:UserWarning"


def pytest_configure(config):
    config.addinivalue_line("filterwarnings", GPU_ONLY_WARNINGS)
    config.addinivalue_line(
        "markers",
        "project_files: checks this project's own files (Dockerfile, CI workflows, e2e script), "
        "not the SGLang tree; deselected by scripts/install-into-python, which runs the tier "
        "inside the image, where only what the Dockerfile copies is (no docs, no Makefile)")
    config.addinivalue_line(
        "markers",
        "l3_store: starts a Mooncake master (the mooncake package, libibverbs1: .ci/run "
        "installs both); deselected by scripts/install-into-python")


@pytest.fixture
def kernel_emulation():
    """The emulated kernels, installed for one test (its recorder: builds and launches)."""
    undo = install_kernel_emulation()
    yield undo
    undo()


@pytest.fixture
def host_modules(kernel_emulation):
    from sglang.srt.mem_cache.pool_host import mamba, mha, mla

    return SimpleNamespace(mha=mha, mla=mla, mamba=mamba, emulation=kernel_emulation)
