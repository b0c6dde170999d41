"""Links in the docs cannot rot: every repository path that README.md, docs/*.md,
bench/RESULTS.md and the run folders' READMEs name exists.

A path is a markdown link's target (relative to the file that holds it) or a word of an
inline code span that starts with one of the repository's top-level folders or files
(relative to the root). Code blocks are commands, not references, and are left out. A
path given "at commit <hash>" names a file of the history, not of the tree: it is looked
up in that commit where the checkout has it.
"""
from __future__ import annotations

import glob
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The docs are not in the image: the tier it runs leaves these out.
pytestmark = pytest.mark.project_files
RESULT_FOLDERS = ("bench/results", "docs/runs")
# Outputs, not sources; and sglang/, the pinned SGLang checkout, whose name the docs use for
# the package (`sglang/srt/...`), not for that folder.
NOT_IN_THE_TREE = {".git", ".venv", "build", "dist", ".pytest_cache", "sglang"}
PLACEHOLDERS = ("<", "$", "NNNN")   # `bench/<run>/`, `$OUT/x`, `patches/NNNN-subject.patch`


def documents() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in RESULT_FOLDERS:
        found += sorted((ROOT / folder).rglob("README.md"))
    return found


def without_code_blocks(text: str) -> str:
    """The text with fenced code blocks blanked out (their lines kept, so numbers hold)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else line)
    return "\n".join(out)


def top_level_names(root: Path = ROOT) -> set[str]:
    return {p.name for p in root.iterdir() if p.name not in NOT_IN_THE_TREE}


def expand_braces(word: str) -> list[str]:
    """`run-{1,2}.json` -> run-1.json, run-2.json (as the shell expands it)."""
    match = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    if not match:
        return [word]
    return [w for part in match.group(1).split(",")
            for w in expand_braces(word[:match.start()] + part + word[match.end():])]


HISTORIC = re.compile(r"^\s+at commit ([0-9a-f]{7,40})\b")


def references(text: str, names: set[str]) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """(link targets, repository paths, (path, commit) of the history) in a markdown text."""
    text = without_code_blocks(text)
    links = [target for target in re.findall(r"\]\(([^)\s]+)\)", text)
             if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")]
    paths, historic = [], []
    for span in re.finditer(r"`([^`]+)`", text):
        words = span.group(1).split()
        for word in words:
            word = re.sub(r"::.*$", "", word.strip("(),;:'\"")).rstrip(".")
            if any(p in word for p in PLACEHOLDERS) or "/" not in word and word not in names:
                continue
            if word.split("/")[0] not in names:
                continue
            at = HISTORIC.match(text[span.end():])
            if at and len(words) == 1:
                historic.append((word, at.group(1)))
            else:
                paths.append(word)
    return [link.split("#")[0] for link in links], paths, historic


def missing_paths(document: Path, root: Path = ROOT) -> list[str]:
    links, paths, _ = references(document.read_text(), top_level_names(root))
    missing = [f"link {link}" for link in links if link and not (document.parent / link).exists()]
    for path in paths:
        for one in expand_braces(path):
            if not (glob.glob(str(root / one)) if "*" in one else (root / one).exists()):
                missing.append(one)
    return missing


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_document_names_exists(document):
    assert missing_paths(document) == []


def test_paths_given_at_a_commit_were_in_that_commit():
    historic = {ref for doc in documents() for ref in references(doc.read_text(), top_level_names())[2]}
    for path, commit in sorted(historic):
        known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                               capture_output=True).returncode == 0
        if known:   # a shallow checkout may not have it
            held = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}:{path}"], capture_output=True)
            assert held.returncode == 0, f"{path} is not in commit {commit}"


def test_missing_paths_and_links_are_found(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "a.json").write_text("{}")
    (tmp_path / "bench" / "run-1.json").write_text("{}")
    doc = tmp_path / "bench" / "doc.md"
    doc.write_text("See `bench/a.json`, `python3 bench/b.json --out bench/run-{1,2}.json`,\n"
                   "[a](a.json) [c](c.png) [web](https://example.org) `bench/*.json` `bench/*.png`\n"
                   "`bench/gone.py` at commit 8087315, `bench/<run>/x.json`\n"
                   "```sh\npython3 bench/in-a-block.json\n```\n")
    assert missing_paths(doc, tmp_path) == ["link c.png", "bench/b.json", "bench/run-2.json", "bench/*.png"]
    assert references(doc.read_text(), {"bench"})[2] == [("bench/gone.py", "8087315")]
