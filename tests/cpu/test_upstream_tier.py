"""tests/upstream against an SGLang without its test package: one line saying so."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_an_sglang_without_sglang_test_is_named_in_one_line(tmp_path):
    """The SGLang without sglang/test is the only one pytest can import: an SGLang installed
    editable through setuptools' import finder (the image's, from a .pth in site-packages)
    would resolve sglang.test past any sglang/ on PYTHONPATH. So the interpreter starts
    without site (-S: no .pth file runs) and is given the caller's import path explicitly."""
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    path = [p for p in sys.path if p and Path(p).exists()]
    proc = subprocess.run([sys.executable, "-S", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/upstream"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), *path])})
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage error
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "sglang.test" in lines[0], lines
