"""A stand-in for `python -m sglang.launch_server` in the server comparison's tests
(harness.fakes.fake_tree puts it in a tree as sglang/launch_server.py).

Answers /health_generate and /generate like SGLang's server (greedy ids, top logprobs,
cache details) and /server_info (which tree it came from, kvcached on or off, its GPUs,
its PYTHONPATH and the pid of the process it started, as SGLang's server starts its
scheduler). A prompt seen before is a host hit (a storage hit with
--hicache-storage-backend: a file store's folder must exist, a Mooncake master must accept
its client); kvcached on logs its allocation line. With FAKE_MOONCAKE_DIR a Mooncake client
keeps what it stores in a file of that folder (its segment) named by its tag, sees what
every live client of its tag stored, and removes its file when stopped, as a Mooncake
client's objects go with its segment. The pristine tree (sglang.PATCHED false) with
kvcached on dies at its first hit, as 0.5.20 does at the first backup. Where SGLang's plugin
loader would find the trained-scale weights plugin (its entry point on the path), it prints
that plugin's line, as a dummy-weight server does. By environment:
  FAKE_SKEW=1          kvcached answers differ from native's by one token id;
  FAKE_HANG=1          /generate never answers;
  FAKE_IMPORT=module   imported at start (as SGLang's DeepSeek paths import deep_gemm);
  FAKE_TENSORS=n       the plugin's tensor count (default 42).
"""
import argparse
import glob
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


def main() -> None:
    import sglang
    if os.environ.get("FAKE_IMPORT"):  # as SGLang's DeepSeek and EAGLE paths import deep_gemm
        __import__(os.environ["FAKE_IMPORT"])
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    ap.add_argument("--page-size", type=int)
    ap.add_argument("--hicache-storage-backend")
    ap.add_argument("--hicache-storage-backend-extra-config")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--pp-size", type=int, default=1)
    args, _ = ap.parse_known_args()
    elastic = os.environ.get("ENABLE_KVCACHED") == "true"
    # a process it started, as SGLang's server starts its scheduler: a stop must reach it too
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    store = os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
    if args.hicache_storage_backend == "mooncake":
        config = json.loads(args.hicache_storage_backend_extra_config)
        host, port = config["master_server_address"].rsplit(":", 1)
        socket.create_connection((host, int(port)), timeout=5).close()
        print(f"Using Mooncake config prefix: {config['extra_backend_tag']}", flush=True)
    elif args.hicache_storage_backend and not (store and os.path.isdir(store)):
        sys.exit("RuntimeError: no storage directory")
    segments = os.environ.get("FAKE_MOONCAKE_DIR") if args.hicache_storage_backend == "mooncake" else None
    if segments:
        tag = os.path.join(segments, config["extra_backend_tag"])
        segment = f"{tag}.{os.getpid()}"
        open(segment, "w").close()
        signal.signal(signal.SIGTERM, lambda *a: (os.remove(segment), os._exit(0)))
    if elastic:
        print("[kvcached][INFO] VirtualKV Cache is allocated (group_id=0). #tokens: 4096", flush=True)
    plugins = importlib.metadata.entry_points(group="sglang.srt.plugins")
    if any(p.value == "trained_scale_weights:register" for p in plugins):
        for rank in range(args.tp_size * args.pp_size):
            print(f"trained-scale dummy weights drawn: {os.environ.get('FAKE_TENSORS', '42')} tensors", file=sys.stderr,
                  flush=True)
    seen = set()
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path == "/generate":
                body = self.generate(body)
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            if self.path != "/server_info":   # /health_generate and the rest
                return self.do_POST()
            info = {"patched": sglang.PATCHED, "kvcached": elastic, "child": child.pid,
                    "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"), "pythonpath": os.environ.get("PYTHONPATH")}
            data = json.dumps(info).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def generate(self, req):
            if os.environ.get("FAKE_HANG"):
                time.sleep(120)
            ids = req["input_ids"]
            key = json.dumps(ids)
            stored = segments and any(key in open(f).read().splitlines() for f in glob.glob(tag + ".*"))
            hit = (len(ids) - 1) // args.page_size * args.page_size if tuple(ids) in seen or stored else 0
            seen.add(tuple(ids))
            if segments:
                with open(segment, "a") as f:
                    f.write(key + "\n")
            if hit and elastic and not sglang.PATCHED:
                print("AttributeError: 'ElasticMHATokenToKVPool' object has no attribute 'k_data_ptrs'", flush=True)
                os._exit(1)
            skew = 1 if elastic and os.environ.get("FAKE_SKEW") else 0
            out = [(sum(ids) + i + skew) % 997 for i in range(req["sampling_params"]["max_new_tokens"])]
            tops = [[[-0.25, t, None], [-1.5, t + 1, None]] for t in out]
            kind = "storage" if args.hicache_storage_backend else "host"
            details = {"device": 0, "host": 0, **({"storage": 0} if args.hicache_storage_backend else {})}
            details[kind] = hit
            return {"output_ids": out, "meta_info": {"cached_tokens": hit, "cached_tokens_details": details,
                    "output_token_logprobs": [[-0.25, t, None] for t in out], "output_top_logprobs": tops}}
    HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
