"""The mutation run's parts (tests/mutation, `make mutants`) on small inputs.

The run itself takes tens of minutes; these check what it relies on: which lines count
as added code, which mutants a line gets, and that a mutated module is really
re-imported by the forked child (a stale module would let every mutant survive).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import types

import pytest

from tests.mutation.operators import line_mutants
from tests.mutation.series_lines import added_lines, code_lines
from tests.mutation.worker import dependents, evict

SOURCE = '''"""Module docstring."""


def f(stride: int | None = None, element_size: int = 16) -> int:
    """Docstring."""
    # a comment
    stride = stride or element_size
    if stride % 16 != 0:
        raise ValueError(f"stride {stride} is not a multiple of {16}")
    return launch(
        stride,
        element_size * 2,
    )
'''


def mutated(lineno):
    return {m.mutated.strip() for m in line_mutants("m.py", SOURCE, lineno)}


def test_only_code_lines_count():
    assert code_lines(SOURCE) == {4, 7, 8, 9, 10, 11, 12, 13}
    assert added_lines("a\nb\nc\n", "a\nx\nb\nc\ny\n") == [2, 5]


def test_a_stride_default_can_be_dropped():
    assert {"stride = element_size", "stride = stride", "stride = stride and element_size", "pass"} == mutated(7)


def test_conditions_compares_and_constants():
    assert {"if not (stride % 16 != 0):", "if stride % 16 == 0:", "if stride // 16 != 0:", "if stride % 17 != 0:",
            "if stride % 0 != 0:", "if stride % 16 != 1:"} <= mutated(8)


def test_arguments_of_a_multi_line_call_are_dropped_or_passed_as_none():
    assert {"", "None,"} <= mutated(11)
    assert {"", "None,", "element_size // 2,", "element_size,", "2,", "element_size * 3,"} <= mutated(12)


def test_annotations_and_messages_are_left_alone():
    assert mutated(4) == {"def f(stride: int | None = None, element_size: int = 17) -> int:",
                          "def f(stride: int | None = None, element_size: int = 0) -> int:"}
    # Inside the f-string, 16 is text; the message itself can go.
    assert mutated(9) == {"pass", "raise ValueError()", "raise ValueError(None)"}


def test_a_mutated_module_and_its_importers_are_unloaded_with_their_package_attribute():
    package, child, user = (types.ModuleType(n) for n in ("pkg_m", "pkg_m.child", "user_m"))
    package.child = child
    sys.modules.update({"pkg_m": package, "pkg_m.child": child, "user_m": user})
    try:
        graph = {"pkg_m": set(), "pkg_m.child": set(), "user_m": {"pkg_m.child", "pkg_m"}}
        assert dependents(graph, "pkg_m.child") == {"pkg_m.child", "user_m"}
        evict(dependents(graph, "pkg_m.child"))
        assert "pkg_m.child" not in sys.modules and "user_m" not in sys.modules
        assert not hasattr(package, "child")  # `from pkg_m import child` must import it again
    finally:
        for name in ("pkg_m", "pkg_m.child", "user_m"):
            sys.modules.pop(name, None)


def test_a_run_with_nothing_left_to_judge_reports_zero(tmp_path, monkeypatch):
    """A rerun whose mutants were all killed or are now listed as equivalent starts no
    worker (a baseline of no test files would have nothing to preload) and exits 0."""
    from tests.mutation import run

    monkeypatch.setattr(run, "build_trees", lambda run_dir, jobs: (tmp_path, tmp_path, [tmp_path / "worker0"]))
    monkeypatch.setattr(run, "enumerate_mutants", lambda *args: ([], 0))
    monkeypatch.setattr(run, "Worker", lambda *args: pytest.fail("a worker started with no mutant to run"))
    args = argparse.Namespace(jobs=1, limit=None, files=[], timeout_factor=3.0, list=False, rerun=None,
                              out=tmp_path / "report.json")
    assert run.run(args, tmp_path, time.time()) == 0
    assert json.loads(args.out.read_text())["summary"]["total"] == 0
