"""A stand-in for SGLang's benchmark client in the server benchmark's tests.

Takes bench_serving's flags (those it needs: --base-url, --output-file, the gsp sizes,
--flush-cache), flushes the server's cache as bench_serving does after its warm-up, asks
the server (bench_server.py beside it) which variant it is and how many runs it
has served, and appends one result line as bench_serving does: the variant's speed from
SPEEDS, drifting by DRIFT per run the server has served before, so that every variant's
ratio to native changes from round to round. FAKE_CLIENT_FAIL_ON=<layout> makes it fail
against that layout's server.
"""
import argparse
import json
import os
import sys
import urllib.request

# variant (kvcached layout or None, HiCache on) -> (requests/s at its first run, drift a run)
SPEEDS = {(None, True): (10.0, 0.02), ("contiguous", True): (10.3, -0.02), ("per-layer", True): (9.0, 0.02),
          (None, False): (4.0, 0.0), ("contiguous", False): (3.6, 0.01)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url")
    ap.add_argument("--output-file")
    ap.add_argument("--gsp-num-groups", type=int)
    ap.add_argument("--gsp-prompts-per-group", type=int)
    ap.add_argument("--gsp-num-turns", type=int, default=1)
    ap.add_argument("--gsp-output-len", type=int)
    ap.add_argument("--flush-cache", action="store_true")
    ap.add_argument("--cache-report", action="store_true")
    args, _ = ap.parse_known_args()
    if args.flush_cache:
        urllib.request.urlopen(urllib.request.Request(args.base_url + "/flush_cache?timeout=60", data=b""), timeout=30)
    info = json.load(urllib.request.urlopen(args.base_url + "/server_info", timeout=30))
    who = info["fake"]
    if who["layout"] and os.environ.get("FAKE_CLIENT_FAIL_ON") == who["layout"]:
        sys.exit("ValueError: Warmup failed - fake")
    speed, drift = SPEEDS[(who["layout"], who["hicache"])]
    rps = speed * (1 + drift * (info["runs"] - 1))
    cached = 800
    host = 600 if who["hicache"] else 0
    result = {"completed": args.gsp_num_groups * args.gsp_prompts_per_group * args.gsp_num_turns, "duration": 10.0,
              "request_throughput": rps, "output_throughput": rps * args.gsp_output_len, "mean_ttft_ms": 1000 / rps,
              "median_ttft_ms": 900 / rps, "p99_ttft_ms": 3000 / rps, "median_itl_ms": 100 / rps,
              "cache_report": {"total_prompt_tokens": 1000, "total_cached_tokens": cached,
                               "device_cached_tokens": cached - host, "host_cached_tokens": host}}
    with open(args.output_file, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
