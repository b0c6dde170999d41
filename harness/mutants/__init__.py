"""The mutation audit (`make mutants`, `python -m harness.mutants`): break one line the
series adds at a time and run the CPU tier's tests that run SGLang's code; a mutant that
survives names a test that is missing. An audit run on demand, not part of the tier.

  series_lines.py  the code lines the series adds, located in the patched tree;
  operators.py     each line's one-line mutants; equivalent.py: the reviewed equivalent ones;
  worker.py        one tree copy, SGLang imported once, a fork per mutant;
  run.py           the trees, the baseline, the workers, the report.
"""
