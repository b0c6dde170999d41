"""A stand-in for `python -m sglang.launch_server` in the server benchmark's tests.

Answers what SGLang 0.5.20's benchmark client (`python -m sglang.bench_serving`) asks of a
server: GET /v1/models, /server_info, /health_generate; POST /flush_cache (empties its
cache, counts the flushes: one a benchmark run), streamed POST /generate (cumulative
"text", meta_info with completion_tokens and cached_tokens_details on every chunk) and
streamed POST /v1/chat/completions (content deltas, a usage chunk, an sglext chunk with
cached_tokens_details). Text is words; a prompt's cached tokens are its longest common
prefix (in words) with what it served before; with --enable-hierarchical-cache three
quarters of them are host hits, else all are device hits. /server_info tells which variant
it is (kvcached on and its layout, HiCache on) and how many flushes it has had.
FAKE_DIE_LAYOUT=<layout>: a server of that kvcached layout exits at its second flush.
FAKE_TOKEN_S: seconds per streamed token (default 0.002).
"""
import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--model-path")
    ap.add_argument("--enable-hierarchical-cache", action="store_true")
    args, _ = ap.parse_known_args()
    KVCACHED = os.environ.get("ENABLE_KVCACHED") == "true"
    IDENTITY = {"kvcached": KVCACHED, "hicache": args.enable_hierarchical_cache,
                "layout": ("contiguous" if os.environ.get("KVCACHED_CONTIGUOUS_LAYOUT") == "true" else "per-layer")
                if KVCACHED else None}
    state = {"flushes": 0, "seen": []}
    lock = threading.Lock()
    print("fake bench server up", flush=True)
    if KVCACHED:
        print("[kvcached][INFO] VirtualKV Cache is allocated (group_id=0)", flush=True)


    def hits(words):
        """(device, host) cached tokens of a prompt, and it is remembered."""
        with lock:
            best = 0
            for old in state["seen"]:
                n = 0
                for a, b in zip(old, words):
                    if a != b:
                        break
                    n += 1
                best = max(best, min(n, len(words) - 1))
            state["seen"].append(tuple(words))
        host = best * 3 // 4 if args.enable_hierarchical_cache else 0
        return best - host, host


    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def answer(self, body, code=200):
            data = (json.dumps(body) if not isinstance(body, str) else body).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                return self.answer({"object": "list", "data": [{"id": args.model_path, "object": "model"}]})
            if self.path == "/server_info":
                return self.answer({"fake": IDENTITY, "runs": state["flushes"], "internal_states": []})
            self.answer({})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            path = self.path.partition("?")[0]
            if path == "/flush_cache":
                with lock:
                    state["flushes"] += 1
                    state["seen"].clear()
                if state["flushes"] == 2 and IDENTITY["layout"] and os.environ.get("FAKE_DIE_LAYOUT") == IDENTITY["layout"]:
                    print("RuntimeError: fake scheduler crash", flush=True)
                    os._exit(1)
                return self.answer("Cache flushed.")
            if path == "/generate":
                return self.stream(body["text"].split(), body["sampling_params"]["max_new_tokens"], chat=False)
            if path == "/v1/chat/completions":
                words = " ".join(m["content"] for m in body["messages"]).split()
                return self.stream(words, body["max_completion_tokens"], chat=True)
            self.answer({"error": "not found"}, 404)

        def stream(self, words, n, chat):
            device, host = hits(words)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            out = [f"t{(len(words) * 7 + i) % 50}" for i in range(n)]
            details = {"device": device, "host": host}
            for i in range(n):
                time.sleep(float(os.environ.get("FAKE_TOKEN_S", "0.002")))
                if chat:
                    chunk = {"choices": [{"index": 0, "delta": {"content": (" " if i else "") + out[i]}}]}
                else:
                    chunk = {"text": " ".join(out[:i + 1]), "meta_info": {
                        "completion_tokens": i + 1, "cached_tokens": device + host, "cached_tokens_details": details}}
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            if chat:
                for chunk in ({"choices": [], "usage": {"completion_tokens": n}},
                              {"choices": [], "sglext": {"cached_tokens_details": details}}):
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                with lock:
                    state["seen"].append(tuple(words + out))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True


    ThreadingHTTPServer.daemon_threads = True
    try:
        ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
    except OSError as exc:
        sys.exit(f"OSError: {exc}")


if __name__ == "__main__":
    main()
