"""CPU tier: the real SGLang host-pool classes of the tree on PYTHONPATH (the patched
one under `make test`), over device pools with kvcached's geometry, with the transfer
kernels replaced by exact emulators (tests/support/emulators.py)."""
import pytest

from tests.support import emulators


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "project_files: checks this project's own files (Dockerfile, CI workflows, e2e script), "
        "not the SGLang tree; deselected by scripts/install-into-python, which runs the tier "
        "inside the image where only patches/, scripts/ and tests/ are copied")


@pytest.fixture
def host_modules(monkeypatch):
    from sglang.srt.mem_cache.pool_host import mamba, mha, mla

    emulators.install(monkeypatch, mha, mla, mamba)
    return SimpleModules(mha=mha, mla=mla, mamba=mamba)


class SimpleModules:
    def __init__(self, **modules):
        self.__dict__.update(modules)
