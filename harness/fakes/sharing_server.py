"""A stand-in for `python -m sglang.launch_server` in the sharing benchmark's tests.

Logs what SGLang 0.5.20 logs of its pools at start (`max_total_num_tokens=N` from
--max-total-tokens; with --enable-hierarchical-cache `... host pool: N tokens, G GB host
memory.` from --hicache-size), kvcached's allocation line where ENABLE_KVCACHED=true, and
the trained-scale weights plugin's line when its entry point is on the path. Answers
/health_generate, /flush_cache (empties both tiers) and streamed /generate (input_ids,
greedy; SSE chunks with cumulative output_ids, meta_info with completion_tokens on each,
cached_tokens, cached_tokens_details and num_retractions on the last). Answers are a
function of the prompt. A prompt's cached tokens are the longest whole-page prefix it shares
with a cached prompt, from the device or else from host: the device keeps prompts up to its
pool (--max-total-tokens; with kvcached on, at most KVCACHED_MAX_CACHED_TOKENS, kvcached's
cap on cached tokens), evicting the oldest to host (HiCache on) or dropping them; host keeps
up to --hicache-size GB at FAKE_BYTES_PER_TOKEN (16384) a token. With kvcached on it keeps
a counters segment like kvcached's (three int64: limit, used, reserved bytes) named
KVCACHED_IPC_NAME in SHARING_FAKE_SHM.
  FAKE_WRONG_ON=<part of the IPC name>  that server's answers with host hits are wrong;
  FAKE_POOL_SHORT=<part of the IPC name or "native">  that server's pool is half the asked;
  FAKE_RETRACT_EVERY=k                  every k-th answer was retracted once (meta_info and
                                        the scheduler's log line);
  FAKE_TOKEN_S=seconds                  time a streamed token (default 0.002).
"""
import argparse
import importlib.metadata
import json
import os
import struct
import sys
import threading
import time
from collections import Counter, OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--max-total-tokens", type=int)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--enable-hierarchical-cache", action="store_true")
    ap.add_argument("--hicache-size", type=float, default=0.0)
    args, _ = ap.parse_known_args()
    BPT = int(os.environ.get("FAKE_BYTES_PER_TOKEN", "16384"))
    RECORD = struct.Struct("=qqq")
    elastic = os.environ.get("ENABLE_KVCACHED") == "true"
    ipc = os.environ.get("KVCACHED_IPC_NAME", "") if elastic else "native"
    segment = os.path.join(os.environ.get("SHARING_FAKE_SHM", "/nonexistent"), ipc) if elastic else None
    page = args.page_size
    short = os.environ.get("FAKE_POOL_SHORT")
    pool = args.max_total_tokens // (2 if short and short in ipc else 1)
    cap = int(os.environ.get("KVCACHED_MAX_CACHED_TOKENS", "-1")) if elastic else -1
    device_room = pool if cap < 0 else min(pool, cap)
    host_room = int(args.hicache_size * 1e9 // BPT) if args.enable_hierarchical_cache else 0
    if any(p.value == "trained_scale_weights:register"
           for p in importlib.metadata.entry_points(group="sglang.srt.plugins")):
        print("trained-scale dummy weights drawn: 7 tensors (tp rank 0)", flush=True)
    print(f"max_total_num_tokens={pool}, chunked_prefill_size=8192, max_prefill_tokens=16384, "
          f"max_running_requests=64, context_len=4096, available_gpu_mem=10.00 GB", flush=True)
    if args.enable_hierarchical_cache:
        print(f"Allocating kv hierarchical KV host pool: {host_room} tokens, {args.hicache_size:.2f} GB host memory.",
              flush=True)
    if elastic:
        print(f"[kvcached][INFO] VirtualKV Cache is allocated (group_id=0). #tokens: {pool}", flush=True)
        if cap >= 0:
            print(f"[kvcached] UnifiedRadixCache evictable size capped at {cap} tokens (KVCACHED_MAX_CACHED_TOKENS)",
                  flush=True)

    lock = threading.Lock()
    tiers = {"device": OrderedDict(), "host": OrderedDict()}          # prompt -> tokens, oldest first
    index = {"device": Counter(), "host": Counter()}                  # whole-page prefix -> prompts holding it
    state = {"running": 0, "answers": 0}

    def prefixes(ids):
        return [tuple(ids[:n]) for n in range(page, len(ids) + 1, page)]

    def put(tier, key):
        tiers[tier][key] = len(key)
        index[tier].update(prefixes(key))

    def drop(tier, key):
        del tiers[tier][key]
        index[tier].subtract(prefixes(key))

    def publish():
        if segment:
            with open(segment, "wb") as f:
                f.write(RECORD.pack(pool * BPT, (sum(tiers["device"].values()) + state["running"]) * BPT, 0))

    def hit(tier, ids):
        best = 0
        for n in range(page, len(ids), page):        # the last token is always computed
            if index[tier][tuple(ids[:n])] <= 0:
                break
            best = n
        return best

    def begin(ids):
        with lock:
            dev = hit("device", ids)
            hst = max(0, hit("host", ids) - dev) if host_room else 0
            state["running"] += len(ids)
            publish()
        return dev, hst

    def end(ids):
        with lock:
            state["running"] -= len(ids)
            key = tuple(ids)
            for tier in ("device", "host"):
                if key in tiers[tier]:
                    drop(tier, key)
            put("device", key)
            while sum(tiers["device"].values()) > device_room:
                old = next(iter(tiers["device"]))
                drop("device", old)
                if host_room:
                    put("host", old)
            while sum(tiers["host"].values()) > host_room:
                drop("host", next(iter(tiers["host"])))
            state["answers"] += 1
            n = state["answers"]
            publish()
        every = int(os.environ.get("FAKE_RETRACT_EVERY", "0"))
        retracted = int(bool(every) and n % every == 0)
        if retracted:
            print("KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 64", flush=True)
        return retracted

    publish()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.do_POST()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            path = self.path.partition("?")[0]
            if path == "/health_generate":
                return self.reply(200, {})
            if path == "/flush_cache":
                with lock:
                    for tier in tiers:
                        tiers[tier].clear()
                        index[tier].clear()
                    publish()
                return self.reply(200, {"text": "Cache flushed."})
            if path != "/generate":
                return self.reply(404, {})
            ids = body["input_ids"]
            n = body["sampling_params"]["max_new_tokens"]
            dev, hst = begin(ids)
            out = [(sum(ids) * 31 + 7 * i) % 1000 for i in range(n)]
            wrong = os.environ.get("FAKE_WRONG_ON")
            if hst and wrong and wrong in ipc:
                out[min(2, n - 1)] += 1
            retracted = 0
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(1, n + 1):
                    time.sleep(float(os.environ.get("FAKE_TOKEN_S", "0.002")))
                    meta = {"completion_tokens": i}
                    if i == n:
                        retracted = end(ids)
                        ids = None
                        meta.update({"cached_tokens": dev + hst, "num_retractions": retracted,
                                     **({"cached_tokens_details": {"device": dev, "host": hst}} if dev + hst else {})})
                    self.wfile.write(b"data: " + json.dumps({"output_ids": out[:i], "meta_info": meta}).encode()
                                     + b"\n\n")
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                if ids is not None:
                    end(ids)

    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    sys.exit(main())
