"""What the differential gate must cover, read from the SGLang source tree (no import).

The list is derived, not written down, so that a class or builder SGLang adds cannot be
forgotten: the source files are parsed with `ast` (importing them would need CUDA for
some), and

* every host-pool class is a class anywhere under `sglang/srt` that derives, directly
  or through other classes, from `HostKVCache` (SGLang's host-pool base; `MambaPoolHost`
  is one of them);
* every builder is a public top-level function of
  `sglang/srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py` or a class of that module
  deriving from its `StackStrategy`.

Bases are matched by their last name (`pool_host.HostKVCache` and `HostKVCache` alike).
"""
from __future__ import annotations

import ast
from pathlib import Path

HOST_POOL_BASE = "HostKVCache"
ASSEMBLER = Path("sglang/srt/mem_cache/hybrid_cache/hybrid_pool_assembler.py")
STRATEGY_BASE = "StackStrategy"


def _base_names(node: ast.ClassDef) -> list[str]:
    names = []
    for base in node.bases:
        if isinstance(base, ast.Name):
            names.append(base.id)
        elif isinstance(base, ast.Attribute):
            names.append(base.attr)
    return names


def _classes(tree: ast.Module) -> dict[str, list[str]]:
    return {node.name: _base_names(node) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def _subclasses(classes: list[tuple[str, list[str]]], root: str) -> set[str]:
    """Names of the classes deriving from `root`, given (name, base names) pairs."""
    found = {root}
    while True:
        more = {name for name, bases in classes if name not in found and found.intersection(bases)}
        if not more:
            return found - {root}
        found |= more


def host_pool_classes(tree_root: Path) -> dict[str, str]:
    """{class name: module path} of every HostKVCache subclass under sglang/srt."""
    tree_root = Path(tree_root)
    srt = tree_root / "sglang" / "srt"
    if not srt.is_dir():
        raise FileNotFoundError(f"no SGLang source tree at {tree_root} (expected {srt})")
    texts = {path: path.read_text(encoding="utf-8", errors="replace") for path in sorted(srt.rglob("*.py"))}
    # Parse only the files that name a class of the hierarchy found so far (parsing
    # all of sglang/srt takes seconds); repeat until no file adds a class.
    classes: list[tuple[str, list[str], str]] = []
    parsed: set[Path] = set()
    names = {HOST_POOL_BASE}
    while True:
        todo = [p for p, text in texts.items() if p not in parsed and any(n in text for n in names)]
        if not todo:
            break
        for path in todo:
            module = str(path.relative_to(tree_root))
            classes += [(name, bases, module)
                        for name, bases in _classes(ast.parse(texts[path], filename=module)).items()]
            parsed.add(path)
        names = {HOST_POOL_BASE} | _subclasses([(name, bases) for name, bases, _ in classes], HOST_POOL_BASE)
    found = _subclasses([(name, bases) for name, bases, _ in classes], HOST_POOL_BASE)
    where: dict[str, str] = {}
    for name, _, module in classes:
        if name in found | {HOST_POOL_BASE}:
            if name in where:  # one name, two classes: the derivation above would confuse them
                raise ValueError(f"two classes named {name}: {where[name]} and {module}")
            where[name] = module
    return {name: where[name] for name in sorted(found)}


def assembler_builders(tree_root: Path) -> list[str]:
    """Public functions and StackStrategy classes of hybrid_pool_assembler.py."""
    path = Path(tree_root) / ASSEMBLER
    module = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    functions = [node.name for node in module.body
                 if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]
    strategies = sorted(_subclasses(list(_classes(module).items()), STRATEGY_BASE))
    return sorted(functions) + strategies
