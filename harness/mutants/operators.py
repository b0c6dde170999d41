"""One-line mutants of a source line: each changes one thing a test should notice.

Operators (each yields the whole new line; the rest of the file is unchanged):

* ``compare``: swap one comparison (== !=, < >=, > <=, <= <, >= >, is / is not, in / not in);
* ``arith``: swap one arithmetic operator (+ -, * //, // *, / *, % //), or keep only one side;
* ``bool``: and <-> or, or keep one operand (``stride or element_size`` -> ``element_size``);
* ``not``: drop a ``not`` or a unary minus;
* ``ifexp``: keep one branch of ``a if c else b``;
* ``const``: change an int (n -> n + 1, n -> 0) or flip a bool;
* ``arg``: drop one argument of a call, or pass None for it (keyword or positional),
  also when the argument sits alone on a line of a multi-line call;
* ``cond``: negate the test of an ``if`` / ``elif`` / ``while`` / ``assert``;
* ``return``: return None instead of the value;
* ``delete``: replace a one-line statement with ``pass``.

Nodes inside annotations and string formatting are left alone (no behaviour), so are
lines that do not parse to anything mutable. Mutants are de-duplicated by text.
"""
from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

COMPARE_SWAP = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE,
                ast.LtE: ast.Gt, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
COMPARE_EDGE = {ast.LtE: ast.Lt, ast.GtE: ast.Gt, ast.Lt: ast.LtE, ast.Gt: ast.GtE}
ARITH_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
              ast.Div: ast.Mult, ast.Mod: ast.FloorDiv}
STATEMENTS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Raise, ast.Assert, ast.Delete,
              ast.Return)


@dataclass(frozen=True)
class Mutant:
    path: str
    line: int
    operator: str
    original: str
    mutated: str

    @property
    def key(self):
        """Identity that survives line-number shifts: the file, the line's text, the mutant's."""
        return (self.path, self.original.strip(), self.mutated.strip())


def _skipped_nodes(tree: ast.AST) -> set[int]:
    """ids of nodes inside annotations and f-strings."""
    roots = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            roots.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            roots.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
        elif isinstance(node, ast.JoinedStr):
            roots.append(node)
    return {id(n) for root in roots for n in ast.walk(root)}


class _Line:
    def __init__(self, text: str):
        self.text, self.raw = text, text.encode()
        self.indent = text[: len(text) - len(text.lstrip())]
        self.out: list[tuple[str, str]] = []

    def splice(self, start: int, end: int, replacement: str, operator: str):
        new = (self.raw[:start] + replacement.encode() + self.raw[end:]).decode()
        if new != self.text:
            self.out.append((operator, new))

    def replace(self, node, new_node, operator):
        self.splice(node.col_offset, node.end_col_offset, ast.unparse(new_node), operator)


def _on(node, lineno):
    return getattr(node, "lineno", None) == lineno and node.end_lineno == lineno


def _expression_mutants(node, line: _Line):
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for table in (COMPARE_SWAP, COMPARE_EDGE):
                if type(op) in table:
                    new = copy.deepcopy(node)
                    new.ops[i] = table[type(op)]()
                    line.replace(node, new, "compare")
    elif isinstance(node, ast.BinOp) and type(node.op) in ARITH_SWAP:
        line.replace(node, ast.BinOp(node.left, ARITH_SWAP[type(node.op)](), node.right), "arith")
        line.replace(node, node.left, "arith")
        line.replace(node, node.right, "arith")
    elif isinstance(node, ast.BoolOp):
        other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        line.replace(node, ast.BoolOp(other, node.values), "bool")
        for value in node.values:
            line.replace(node, value, "bool")
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        line.replace(node, node.operand, "not")
    elif isinstance(node, ast.IfExp):
        line.replace(node, node.body, "ifexp")
        line.replace(node, node.orelse, "ifexp")
    elif isinstance(node, ast.Constant):
        if isinstance(node.value, bool):
            line.replace(node, ast.Constant(not node.value), "const")
        elif isinstance(node.value, int):
            line.replace(node, ast.Constant(node.value + 1), "const")
            if node.value != 0:
                line.replace(node, ast.Constant(0), "const")


def _call_argument_mutants(call: ast.Call, lineno: int, line: _Line):
    """Drop an argument, or pass None for it: arguments lying entirely on this line."""
    items = [(a, a) for a in call.args] + [(k, k.value) for k in call.keywords if k.arg is not None]
    for i, (item, value) in enumerate(items):
        if isinstance(item, ast.Starred) or not (_on(item, lineno) and _on(value, lineno)):
            continue
        start, end = item.col_offset, item.end_col_offset
        rest = line.raw[end:]
        stripped = rest.lstrip()
        if stripped.startswith(b","):
            end += len(rest) - len(stripped) + 1
            end += len(line.raw[end:]) - len(line.raw[end:].lstrip(b" "))
        elif i > 0 and _on(items[i - 1][0], lineno):  # last argument: take the comma before it
            before = line.raw[:start].rstrip()
            if before.endswith(b","):
                start = len(before) - 1
        line.splice(start, end, "", "arg")
        if not (isinstance(value, ast.Constant) and value.value is None):
            line.splice(value.col_offset, value.end_col_offset, "None", "arg")


def line_mutants(path: str, source: str, lineno: int, tree: ast.AST | None = None) -> list[Mutant]:
    tree = tree or ast.parse(source)
    text = source.splitlines()[lineno - 1]
    line = _Line(text)
    skipped = _skipped_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Call) and node.lineno <= lineno <= node.end_lineno:
            _call_argument_mutants(node, lineno, line)
        if isinstance(node, (ast.If, ast.While, ast.Assert)) and _on(node.test, lineno) and node.lineno == lineno:
            line.splice(node.test.col_offset, node.test.end_col_offset, f"not ({ast.unparse(node.test)})", "cond")
        if not _on(node, lineno):
            continue
        if isinstance(node, ast.expr):
            _expression_mutants(node, line)
        if isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            line.splice(node.col_offset, node.end_col_offset, "return None", "return")
        if isinstance(node, STATEMENTS) and not isinstance(node, ast.Return):
            line.splice(node.col_offset, node.end_col_offset, "pass", "delete")
    seen, mutants = set(), []
    for operator, new in line.out:
        if new not in seen:
            seen.add(new)
            mutants.append(Mutant(path, lineno, operator, text, new))
    return mutants
