#!/usr/bin/env python3
"""Repository paths that the Markdown files name in code spans exist (`make lint`; links
are lychee's).

    ci/doc_paths.py [FILE.md...]      (default: every tracked *.md outside patches/)

A word of an inline code span names a path when it starts with one of the repository's
top-level files or folders (`bench/plot.py`, `docs/`); `{a,b}` expands as in the shell and
`*` globs; a word holding `<`, `$` or `NNNN` is a placeholder. Fenced code blocks are
commands, not references. A path followed by "at commit HASH" names a file of the history:
it must be in that commit, where the checkout has the commit. Prints one line per path
not found; exit 1 if any.
"""
from __future__ import annotations

import glob
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Outputs, not sources; and sglang/, the pinned SGLang checkout, whose name the docs use for
# the package (`sglang/srt/...`), not for that folder.
NOT_IN_THE_TREE = {".git", ".venv", "build", "dist", ".pytest_cache", "sglang"}
PLACEHOLDERS = ("<", "$", "NNNN")
AT_COMMIT = re.compile(r"^\s+at commit ([0-9a-f]{7,40})\b")


def expand_braces(word: str) -> list[str]:
    match = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    if not match:
        return [word]
    return [w for part in match.group(1).split(",")
            for w in expand_braces(word[:match.start()] + part + word[match.end():])]


def in_commit(root: Path, path: str, commit: str) -> bool:
    def git(*args: str) -> bool:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True).returncode == 0
    return not git("cat-file", "-e", f"{commit}^{{commit}}") or git("cat-file", "-e", f"{commit}:{path}")


def missing(document: Path, root: Path = ROOT) -> list[str]:
    """One line per path ``document`` names that ``root`` lacks."""
    names = {p.name for p in root.iterdir() if p.name not in NOT_IN_THE_TREE}
    text = re.sub(r"(?ms)^\s*```.*?^\s*```", lambda m: "\n" * m.group(0).count("\n"), document.read_text())
    out = []
    for span in re.finditer(r"`([^`]+)`", text):
        words = span.group(1).split()
        for word in words:
            word = re.sub(r"::.*$", "", word.strip("(),;:'\"")).rstrip(".")
            if any(p in word for p in PLACEHOLDERS) or word.split("/")[0] not in names:
                continue
            line = text.count("\n", 0, span.start()) + 1
            at = AT_COMMIT.match(text[span.end():])
            if at and len(words) == 1:
                if not in_commit(root, word, at.group(1)):
                    out.append(f"{document.relative_to(root)}:{line}: {word} is not in commit {at.group(1)}")
                continue
            for one in expand_braces(word):
                if not (glob.glob(str(root / one)) if "*" in one else (root / one).exists()):
                    out.append(f"{document.relative_to(root)}:{line}: {one} does not exist")
    return out


def main(argv: list[str]) -> int:
    files = argv or subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.md", ":!:patches/*"], capture_output=True,
                                   text=True, check=True).stdout.split()
    problems = [line for name in files for line in missing((ROOT / name).resolve())]
    print("\n".join(problems) or f"{len(files)} Markdown files: every path named exists")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
