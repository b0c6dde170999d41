"""Runs the upstream-style unit tests (README.md here) against the tree on PYTHONPATH.

sglang.test.test_utils, where CustomTestCase lives, imports SGLang's benchmark client,
whose MMMU dataset imports Hugging Face `datasets` at import time. These tests use none
of it, and the CPU tier does not install `datasets`: a stand-in module is put in its
place when the package is missing (SGLang's CI has the real one)."""

import importlib.util
import sys
import types

if importlib.util.find_spec("datasets") is None:
    stand_in = types.ModuleType("datasets")

    def load_dataset(*args, **kwargs):
        raise RuntimeError(
            "datasets is a stand-in in this test tier (tests/upstream/conftest.py)"
        )

    stand_in.load_dataset = load_dataset
    sys.modules["datasets"] = stand_in


def pytest_configure(config):
    """One line, not a traceback per file, where the SGLang under test lacks its own test
    package (the tests are written against sglang.test, as SGLang's are)."""
    import pytest

    if importlib.util.find_spec("sglang.test") is None:
        raise pytest.UsageError(
            "tests/upstream needs sglang.test (CustomTestCase, the CI registry), which the SGLang on "
            "PYTHONPATH lacks: use a tree that ships sglang/test, as PyPI's wheel does"
        )
