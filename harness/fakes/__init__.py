"""Stand-ins the harness's tools are tested with on the CPU, each a script run as a process.

  compare_server.py   `sglang.launch_server` for the server comparison: greedy ids, top
                      logprobs, host/storage hits, the pristine tree's failure;
  bench_server.py     `sglang.launch_server` for the server benchmark: what SGLang's
                      bench_serving asks of a server, streamed; bench_client.py: its client;
  soak_server.py      `sglang.launch_server` for the soak: streamed answers, device and host
                      caches under kvcached's limit, faults on demand;
  sharing_server.py   `sglang.launch_server` for the sharing benchmark: its pools' log
                      lines, streamed answers with device/host hits and retractions,
                      kvcached's counters;
  mooncake_master.py  `mooncake_master`: serves, exits, never serves or ignores SIGTERM.

`fake_tree(folder, server)` writes a folder holding an `sglang/` package whose
`launch_server` is one of the stand-in servers: the tools launch it as they launch SGLang
(`python -m sglang.launch_server`, the tree first on PYTHONPATH).
"""
from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVERS = ("compare_server", "bench_server", "soak_server", "sharing_server")


def script(name: str) -> Path:
    """The path of a stand-in script of this folder (e.g. "bench_client")."""
    return HERE / f"{name}.py"


def fake_tree(folder: Path, server: str, patched: bool = True) -> Path:
    """`folder`/sglang/ with `server`'s stand-in as launch_server; sglang.PATCHED says which
    tree it stands for (the compare stand-in fails as SGLang as released does). Returns folder."""
    if server not in SERVERS:
        raise ValueError(f"no stand-in server {server!r} (one of {', '.join(SERVERS)})")
    package = Path(folder) / "sglang"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(f"PATCHED = {patched}\n")
    shutil.copy(script(server), package / "launch_server.py")
    return Path(folder)
