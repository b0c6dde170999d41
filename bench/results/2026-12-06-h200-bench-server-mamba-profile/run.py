"""This run's command: bench/bench_server.py with one more variant, kvcached-no-hicache-sync-free
(kvcached-no-hicache with ELASTIC_BENCH_SYNC_FREE=1, which turns on the paged KV allocator's change,
../2026-12-05-h100-bench-server-kvcached-fewer-waits/kvcached_sync_free.py, loaded beside kvcached).
Run from the checkout's root. Same arguments as bench_server.py; `run.py --render report.json`
renders the report."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "bench"))
import bench_server as bs  # noqa: E402

bs.VARIANTS["kvcached-no-hicache-sync-free"] = bs.Variant(
    "kvcached-no-hicache-sync-free", "patched", "contiguous", False, baseline="native-no-hicache",
    kvcached_env=(("ELASTIC_BENCH_SYNC_FREE", "1"),))

if __name__ == "__main__":
    sys.exit(bs.main())
