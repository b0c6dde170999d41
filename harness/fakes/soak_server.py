"""A stand-in for `python -m sglang.launch_server` in the soak harness's tests.

Answers /health_generate, /flush_cache and streamed /generate like SGLang 0.5.20 (SSE
chunks with cumulative output_ids, the last one with meta_info: completion_tokens,
cached_tokens, cached_tokens_details). Greedy tokens are a function of the prompt. A prompt
seen before is a device hit, or a host hit once evicted from the device (to a host pool of
--hicache-ratio times --max-total-tokens). The device holds the running requests' tokens and
the cached ones, like kvcached 0.1.6 under SGLang (kvcached on: a segment named
KVCACHED_IPC_NAME in SOAK_FAKE_SHM, three int64 like kvcached's, `used` kept up to date,
1 MiB in reserve): a finished request's tokens stay cached, at most KVCACHED_MAX_CACHED_TOKENS
(kvcached's default 16000) of them; a raised limit is taken at once, a lowered one only once
the tokens in use fit under it (until then the device keeps what it holds and evicts only to
make room within it). SOAK_FAKE_GPU=<bytes> stands in for the GPU they share: every record in
SOAK_FAKE_SHM (the servers' mapped pages, the ballast's bytes) is memory in use, and a
server maps more only while the rest stays above kvcached's headroom, the total times
(1 - KVCACHED_GPU_UTILIZATION); a request that does not fit once its server's cached
tokens are evicted waits, as in SGLang's queue (at most 30 s, then it runs anyway). A server
stopped by SIGTERM removes its record (kvcached's shutdown does). Faults, by environment:
  FAKE_WRONG_ON=<part of the IPC name>  host-hit answers of that server are wrong;
  FAKE_NOISE=1                          an answer given while another request runs differs
                                        at its last token (batching noise, on every server);
  FAKE_DIE_ON=<part>, FAKE_DIE_AFTER=n  that server exits with an error after n answers;
  FAKE_TOKEN_S=seconds                  time per streamed token (default 0.004).
The trained-scale weights plugin's line is printed when its entry point is on the path.
"""
import argparse
import contextlib
import fcntl
import importlib.metadata
import json
import os
import signal
import struct
import sys
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--max-total-tokens", type=int)
    ap.add_argument("--hicache-ratio", type=float)
    args, _ = ap.parse_known_args()
    BYTES_PER_TOKEN = 16384
    RECORD = struct.Struct("=qqq")
    RESERVE = 1 << 20       # bytes of pages kvcached keeps mapped in reserve (prealloc_size), even when idle
    elastic = os.environ.get("ENABLE_KVCACHED") == "true"
    ipc = os.environ.get("KVCACHED_IPC_NAME", "")
    shm = os.environ.get("SOAK_FAKE_SHM", "/nonexistent")
    segment = os.path.join(shm, ipc) if elastic else None
    gpu_total = int(os.environ.get("SOAK_FAKE_GPU", "0")) if elastic else 0
    headroom = int(gpu_total * (1 - float(os.environ.get("KVCACHED_GPU_UTILIZATION", "0.95"))))
    if any(p.value == "trained_scale_weights:register" for p in importlib.metadata.entry_points(group="sglang.srt.plugins")):
        print("trained-scale dummy weights drawn: 7 tensors (tp rank 0)", file=sys.stderr, flush=True)
    if elastic:
        with open(segment, "wb") as f:
            f.write(RECORD.pack(args.max_total_tokens * BYTES_PER_TOKEN, 0, RESERVE))
        print(f"[kvcached][INFO] VirtualKV Cache is allocated (group_id=0). #tokens: {args.max_total_tokens}", flush=True)

        def leave(*_):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(segment)
            os._exit(0)

        signal.signal(signal.SIGTERM, leave)


    def matches(var):
        part = os.environ.get(var)
        return bool(part) and elastic and part in ipc


    lock = threading.Lock()
    device, host = OrderedDict(), OrderedDict()      # cached prompt -> tokens, LRU first
    state = {"inflight": 0, "answers": 0, "running": 0, "mapped": 0}   # tokens: of requests in flight, on mapped pages
    MAX_CACHED = int(os.environ.get("KVCACHED_MAX_CACHED_TOKENS", "16000"))


    def limit_tokens():
        if not elastic:
            return args.max_total_tokens
        with open(segment, "rb") as f:
            total = RECORD.unpack(f.read(RECORD.size))[0]
        return min(args.max_total_tokens, total // BYTES_PER_TOKEN)


    def in_use():
        return sum(device.values()) + state["running"]


    @contextlib.contextmanager
    def gpu_lock():
        """The stand-in GPU's lock (the shm folder's), held while a server checks and maps."""
        if not gpu_total:
            yield
            return
        fd = os.open(shm, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


    def gpu_room():
        """Tokens this server can map beyond what it has: the stand-in GPU's free bytes above
        kvcached's headroom (unbounded without a stand-in GPU)."""
        if not gpu_total:
            return float("inf")
        held = 0
        for name in os.listdir(shm):
            try:
                with open(os.path.join(shm, name), "rb") as f:
                    _, used, prealloc = RECORD.unpack(f.read(RECORD.size))
                held += used + prealloc
            except (OSError, struct.error):
                pass
        return max(0, gpu_total - headroom - held) // BYTES_PER_TOKEN


    def publish():
        """Write the bytes in use. Pages are mapped as the use grows and given back as it falls,
        except while the use stands above a lowered limit: then the freed tokens stay on pages
        still mapped (kvcached's deferred shrink)."""
        if elastic:
            use = in_use()
            if use > state["mapped"] or use <= limit_tokens():
                state["mapped"] = use
            with open(segment, "r+b") as f:
                total = RECORD.unpack(f.read(RECORD.size))[0]
                f.seek(0)
                f.write(RECORD.pack(total, state["mapped"] * BYTES_PER_TOKEN, RESERVE))


    def evict_to(tokens):
        """Cached tokens, oldest first, to the host pool until the device holds `tokens` at most:
        token by token, like the radix tree (a prompt partly evicted keeps the rest)."""
        while device and in_use() > tokens:
            old = next(iter(device))
            excess = in_use() - tokens
            if device[old] > excess:
                device[old] -= excess
                break
            host[old] = len(old)
            del device[old]
        while sum(host.values()) > args.hicache_ratio * args.max_total_tokens:
            host.popitem(last=False)


    def start(ids):
        """A request begins: (device hit, host hit) tokens; its prompt is in use until it ends.
        It waits while the running requests' tokens and its own exceed what the server can map."""
        key = tuple(ids)
        deadline = time.time() + 30
        while True:
            with lock, gpu_lock():
                mappable = state["mapped"] + gpu_room()
                if state["running"] + len(ids) <= mappable or time.time() > deadline:
                    dev = hst = 0
                    room = max(limit_tokens(), in_use())     # a lowered limit waits until the use fits under it
                    if key in device:
                        dev = len(ids) - 1
                        del device[key]
                    elif key in host:
                        hst = len(ids) - 1
                        del host[key]
                    state["running"] += len(ids)
                    evict_to(min(room, mappable))
                    publish()
                    return dev, hst
            time.sleep(0.005)


    def finish(ids):
        """A request ends: its prompt is cached, the cache kept under KVCACHED_MAX_CACHED_TOKENS."""
        with lock:
            state["running"] -= len(ids)
            device[tuple(ids)] = len(ids)
            while device and sum(device.values()) > MAX_CACHED:
                old, n = device.popitem(last=False)
                host[old] = n
            evict_to(args.max_total_tokens)     # requests run past the limit leave no more than the pool cached
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
            if self.path == "/health_generate":
                return self.reply(200, {})
            path, _, query = self.path.partition("?")
            if path == "/flush_cache":   # ?timeout=s: wait that long for no request to run (SGLang's)
                wait = float(dict(q.split("=", 1) for q in query.split("&") if "=" in q).get("timeout", 0))
                deadline = time.time() + wait
                while state["inflight"] and time.time() < deadline:
                    time.sleep(0.01)
                with lock:
                    if state["inflight"]:
                        return self.reply(400, {"text": "Cache not flushed because there are pending requests"})
                    device.clear()
                    host.clear()
                    publish()
                return self.reply(200, {"text": "Cache flushed."})
            if self.path != "/generate":
                return self.reply(404, {})
            with lock:
                state["inflight"] += 1
                crowded = state["inflight"] > 1
            try:
                self.generate(body, crowded)
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                with lock:
                    state["inflight"] -= 1

        def generate(self, req, crowded):
            ids = req["input_ids"]
            n = req["sampling_params"]["max_new_tokens"]
            dev, hst = start(ids)
            try:
                self.stream(ids, n, dev, hst, crowded)
            finally:
                finish(ids)
            with lock:
                state["answers"] += 1
                die = matches("FAKE_DIE_ON") and state["answers"] >= int(os.environ.get("FAKE_DIE_AFTER", "5"))
            if die:
                print("RuntimeError: fake scheduler crash", flush=True)
                os._exit(1)

        def stream(self, ids, n, dev, hst, crowded):
            out = [(sum(ids) * 31 + i) % 1000 for i in range(n)]
            if hst and matches("FAKE_WRONG_ON"):
                out[min(3, n - 1)] += 1
            if crowded and os.environ.get("FAKE_NOISE"):
                out[-1] += 7
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(1, n + 1):
                time.sleep(float(os.environ.get("FAKE_TOKEN_S", "0.004")))
                chunk = {"output_ids": out[:i], "meta_info": {"completion_tokens": i}}
                if i == n:
                    chunk["meta_info"].update({"cached_tokens": dev + hst,
                                               "cached_tokens_details": {"device": dev, "host": hst}})
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")


    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
