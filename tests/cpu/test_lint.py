"""ci/doc_paths.py, the one check of `make lint` that is not a linter of its own: the
repository paths a Markdown file names in code spans exist."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.project_files  # ci/doc_paths.py lints the checkout's docs


def doc_paths():
    spec = importlib.util.spec_from_file_location("doc_paths", ROOT / "ci" / "doc_paths.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_path_a_doc_names_that_does_not_exist_is_named(tmp_path):
    for name in ("a.json", "run-1.json"):
        (tmp_path / "bench" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "bench" / name).write_text("{}")
    doc = tmp_path / "bench" / "doc.md"
    doc.write_text("See `bench/a.json`, `python3 bench/b.json --out bench/run-{1,2}.json`,\n"
                   "`bench/*.json` `bench/*.png` `bench/<run>/x.json` `other/x`\n"
                   "```sh\npython3 bench/in-a-block.json\n```\n")
    named = [line.rsplit(": ", 1)[1].split()[0] for line in doc_paths().missing(doc, tmp_path)]
    assert named == ["bench/b.json", "bench/run-2.json", "bench/*.png"]
