"""The server comparison (`make e2e`, `python -m harness.compare`): SGLang's real server,
native vs kvcached, one server a row, every row judged against its group's native row.

  matrix.py   what runs: model cases, variants, rows, server flags and environment, traffic;
  verdict.py  what a row's answers, hits and log say against native's, and the table;
  runner.py   the rows run side by side on ports and GPUs, the report written as they finish;
  configs/, prompts/, plugin/   the tiny model configs, the chat prompts of the trained
              checkpoint, and the SGLang plugin that draws dummy weights at a trained scale.
"""
