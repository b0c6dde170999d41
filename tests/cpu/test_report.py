"""`make report`: docs/results.md is what the committed summaries (results/) render, and a
new run's summary, made from its tool's output, shows up in it."""
from __future__ import annotations

import json
import shutil

import pytest

from harness import report, results
from harness.project import ROOT

pytestmark = pytest.mark.project_files


def test_the_committed_results_page_is_what_the_summaries_render():
    assert len(results.load_all()) > 0 and len(results.load_history()) > 0   # every one follows the schema
    assert report.main(["--check"]) == 0, "docs/results.md is stale: run `make report`"


def test_a_new_runs_summary_is_rendered_and_the_stale_page_is_caught(tmp_path):
    folder = tmp_path / "results"
    shutil.copytree(results.RESULTS, folder)
    page = tmp_path / "results.md"
    shutil.copy(ROOT / "docs" / "results.md", page)
    rows = [dict(mode=mode, pool="meta", sglang="/t/sglang", series_applied=f"SGLang at /t: series {state}")
            for mode, state in (("native", "pristine"), ("kvcached-contiguous", "applied"))]
    rows += [dict(mode=mode, pool="MHA", direction="load", host_layout="page_first", batch=4096, GBps=gbps,
                  kernel_us=us, byte_exact=True) for mode, gbps, us in (("native", 50.0, 80.0),
                                                                       ("kvcached-contiguous", 49.0, 81.0))]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"meta": {"gpu": "H200", "torch": "2.11", "page_size": 64}, "rows": rows}))
    doc = results.make("transfer", "2999-01-01-h200-transfer-planted", [run], "a planted run",
                       machine={"gpu": "NVIDIA H200", "gpus": 1}, compiled_ops="none")
    (folder / f"{doc['name']}.json").write_text(json.dumps(doc))
    args = ["--results", str(folder), "--out", str(page), "--plots", str(tmp_path / "plots")]
    assert report.main([*args, "--check"]) == 1            # the page predates the new summary
    assert report.main(args) == 0 and report.main([*args, "--check"]) == 0
    text = page.read_text()
    assert "### 2999-01-01-h200-transfer-planted: a planted run" in text
    assert "| MHA | load | page_first | 4096 | 50.00 | - | 49.00 |" in text
    doc["compiled_ops"] = "maybe"                             # outside the schema: refused, nothing written
    (folder / f"{doc['name']}.json").write_text(json.dumps(doc))
    assert report.main(args) == 2 and page.read_text() == text
