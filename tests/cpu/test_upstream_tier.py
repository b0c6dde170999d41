"""tests/upstream against an SGLang without its test package: one line saying so."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_an_sglang_without_sglang_test_is_named_in_one_line(tmp_path):
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/upstream"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines == ["ERROR: tests/upstream needs sglang.test (CustomTestCase, the CI registry), which the SGLang "
                     "on PYTHONPATH lacks: use a tree that ships sglang/test, as PyPI's wheel does"], lines
