"""The Python lines the patch series adds, located in the patched tree.

The series is read fresh from patches/ on every run: the .py files its patches touch
(scripts/_series.py reads the patches) and, in each, the lines of the patched file that are not in
SGLang 0.5.20's file (the net ``+`` lines of the whole series: a line one patch adds
and a later one rewrites counts once, in its final form). Comments, blank lines and
docstrings are left out; what remains is code a mutant can change.
"""
from __future__ import annotations

import ast
import difflib
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

from harness.project import series_module

NON_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}


@dataclass(frozen=True)
class SeriesFile:
    path: str          # relative to the python/ folder: sglang/...
    lines: tuple       # 1-based line numbers of added code lines in the patched file


def series_py_files() -> list[str]:
    return [f"sglang/{rel}" for rel in series_module().Series().files if rel.endswith(".py")]


def added_lines(pristine: str, patched: str) -> list[int]:
    old, new = pristine.splitlines(), patched.splitlines()
    added = []
    for tag, _i1, _i2, j1, j2 in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes():
        if tag in ("replace", "insert"):
            added += range(j1 + 1, j2 + 1)
    return added


def code_lines(source: str) -> set[int]:
    """Lines holding a token that is code: not a comment, blank, or a docstring."""
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in NON_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines.difference_update(range(node.lineno, node.end_lineno + 1))
    return lines


def series_lines(pristine_root: Path, patched_root: Path) -> list[SeriesFile]:
    """pristine_root and patched_root hold sglang/ (the python/ folders of the two trees)."""
    files = []
    for path in series_py_files():
        patched = (patched_root / path).read_text()
        old = pristine_root / path
        pristine = old.read_text() if old.exists() else ""
        code = code_lines(patched)
        files.append(SeriesFile(path, tuple(n for n in added_lines(pristine, patched) if n in code)))
    return files
