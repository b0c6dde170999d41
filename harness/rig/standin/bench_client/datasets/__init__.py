"""An import-only stand-in for Hugging Face `datasets`, on the path of SGLang's benchmark client only.

SGLang 0.5.20's `sglang.benchmark.datasets` imports `datasets` at import time (for its MMMU
set); the generated sets the server benchmark uses (generated-shared-prefix) never call it.
Put on the client's path only where `datasets` is not installed (harness/bench_server.py)."""


def load_dataset(*args, **kwargs):
    raise RuntimeError("datasets is a stand-in here (harness/rig/standin/bench_client): only SGLang's generated "
                       "benchmark sets work; install the datasets package for the others")
