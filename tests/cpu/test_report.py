"""`make report`: docs/results.md is what the committed summaries (results/) render. A new
run's summary showing up in it: test_harness.py's transfer benchmark test."""
from __future__ import annotations

import pytest

from harness import report, results

pytestmark = pytest.mark.project_files


def test_the_committed_results_page_is_what_the_summaries_render():
    assert len(results.load_all()) > 0 and len(results.load_history()) > 0   # every one follows the schema
    assert report.main(["--check"]) == 0, "docs/results.md is stale: run `make report`"
