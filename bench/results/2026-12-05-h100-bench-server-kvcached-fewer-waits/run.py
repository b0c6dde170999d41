"""This run's command: bench/bench_server.py with one more variant, kvcached-contiguous-sync-free
(kvcached-contiguous with kvcached_sync_free.py switched on). Same arguments as bench_server.py;
`run.py --render report.json` renders the report (the stock tool does not know the variant)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import bench_server as bs  # noqa: E402

bs.VARIANTS["kvcached-contiguous-sync-free"] = bs.Variant(
    "kvcached-contiguous-sync-free", "patched", "contiguous", True,
    kvcached_env=(("ELASTIC_BENCH_SYNC_FREE", "1"),))

if __name__ == "__main__":
    sys.exit(bs.main())
