"""Soak traffic: a fixed catalogue of token-id prompts per model, streamed requests, clients.

The catalogue is finite and fixed by the seed, so that every prompt the load sends can be
answered alone once on the reference server (the oracle, verdict). It holds
multi-turn conversations on shared system prefixes (turn t = prefix + the turns before it,
each a user part and a fixed reply, + its own user part: every turn extends the last one's
prompt), long prompts and short ones. Its distinct tokens exceed what the KV budget lets a
server keep on the device, so prefixes are evicted to host and loaded back, again and
again. Clients pick sessions (a whole conversation in order, a long or a short prompt) at
random from their own seeded generator. `Load` runs them: every request journaled, its
answer checked against the solo reference as it comes; always-on clients and burst clients
(a shared server's only in its burst window, Fleet.boosted; a reference server's in turn).
"""
from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Prompt:
    key: str                   # unique within the model's catalogue, e.g. "c3t2", "long5"
    ids: tuple[int, ...]
    kind: str                  # "turn", "long", "short"


@dataclass(frozen=True)
class Shape:
    """Sizes of a catalogue (tokens). The default keeps every prompt under 3,100 tokens
    (the tiny configs allow 4,096 positions) and about 52,000 distinct tokens in all."""
    prefixes: int = 8
    prefix_tokens: tuple[int, int] = (512, 1024)
    conversations: int = 24
    turns: int = 4
    user_tokens: tuple[int, int] = (64, 256)
    reply_tokens: tuple[int, int] = (32, 64)
    long_prompts: int = 8
    long_tokens: tuple[int, int] = (2048, 3000)
    short_prompts: int = 16
    short_tokens: tuple[int, int] = (32, 128)


@dataclass
class Catalogue:
    prompts: dict[str, Prompt] = field(default_factory=dict)
    conversations: list[list[str]] = field(default_factory=list)   # keys of each conversation's turns
    longs: list[str] = field(default_factory=list)
    shorts: list[str] = field(default_factory=list)

    def distinct_tokens(self) -> int:
        """Tokens of the prompt tree: shared prefixes counted once."""
        seen = set()
        for p in self.prompts.values():
            seen.update(p.ids[:i + 1] for i in range(0, len(p.ids), 64))   # one node per 64 tokens
        return len(seen) * 64


def build_catalogue(seed: int, vocab_size: int, shape: Shape = Shape()) -> Catalogue:
    rng = random.Random(seed)
    ids = lambda bounds: [rng.randrange(100, vocab_size) for _ in range(rng.randint(*bounds))]
    cat = Catalogue()
    prefixes = [ids(shape.prefix_tokens) for _ in range(shape.prefixes)]
    for c in range(shape.conversations):
        history = list(prefixes[c % shape.prefixes])
        keys = []
        for t in range(shape.turns):
            history += ids(shape.user_tokens)
            key = f"c{c}t{t}"
            cat.prompts[key] = Prompt(key, tuple(history), "turn")
            keys.append(key)
            history += ids(shape.reply_tokens)
        cat.conversations.append(keys)
    for kind, count, bounds, bucket in (("long", shape.long_prompts, shape.long_tokens, cat.longs),
                                        ("short", shape.short_prompts, shape.short_tokens, cat.shorts)):
        for i in range(count):
            key = f"{kind}{i}"
            cat.prompts[key] = Prompt(key, tuple(ids(bounds)), kind)
            bucket.append(key)
    return cat


def session(cat: Catalogue, rng: random.Random) -> list[str]:
    """The prompt keys of one client session: a conversation (60 %), a long prompt (20 %)
    or a short one (20 %)."""
    roll = rng.random()
    if roll < 0.6 or not (cat.longs or cat.shorts):
        return list(rng.choice(cat.conversations))
    if roll < 0.8 and cat.longs:
        return [rng.choice(cat.longs)]
    return [rng.choice(cat.shorts or cat.longs)]


def hits(meta: dict) -> dict[str, int]:
    """Cached tokens of a response by tier (details absent when nothing was cached)."""
    details = meta.get("cached_tokens_details") or {}
    cached = int(meta.get("cached_tokens") or 0)
    host, storage = int(details.get("host") or 0), int(details.get("storage") or 0)
    return {"cached": cached, "host": host, "device": int(details.get("device", cached - host - storage))}


def stream_event(line: bytes) -> tuple[str, object]:
    """One line of SGLang's streamed /generate: ("skip", None) for a line that is not data,
    ("done", None) for [DONE], ("error", its text) for a chunk holding only an error, else
    ("chunk", the chunk)."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return "skip", None
    data = line[5:].strip()
    if data == b"[DONE]":
        return "done", None
    chunk = json.loads(data)
    if "error" in chunk and "meta_info" not in chunk:
        return "error", f"server error: {str(chunk['error'])[:300]}"
    return "chunk", chunk


def stream_generate(base: str, ids, max_new_tokens: int, timeout: float,
                    abort_after: float | None = None) -> dict:
    """POST /generate with stream on, greedy. Returns what the run records of it:
    `outcome` ("ok", "aborted": the client hung up after abort_after seconds on purpose,
    "error": with `error`), `ttft` (seconds to the first streamed chunk with tokens),
    `latency`, `output_ids`, cached/host/device hit tokens."""
    url = urlsplit(base)
    body = json.dumps({"input_ids": list(ids), "stream": True,
                       "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                           "ignore_eos": True}}).encode()
    start = time.monotonic()
    rec: dict = {"outcome": "error", "ttft": None, "latency": None}
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=abort_after or timeout)
    chunks = []
    done = False
    try:
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            rec["error"] = f"HTTP {resp.status}: {resp.read(300).decode(errors='replace')}"
            return rec
        while True:
            if abort_after is not None and time.monotonic() - start > abort_after:
                raise socket.timeout("abort")
            line = resp.readline()
            if not line:
                break
            kind, chunk = stream_event(line)
            if kind == "error":
                rec["error"] = chunk
                return rec
            if kind == "done":
                done = True
                break
            if kind == "skip":
                continue
            if rec["ttft"] is None and chunk.get("output_ids"):
                rec["ttft"] = time.monotonic() - start
            chunks.append(chunk)
    except (socket.timeout, TimeoutError) as exc:
        if abort_after is not None:
            rec["outcome"] = "aborted"
            rec["after_s"] = round(time.monotonic() - start, 3)
        else:
            rec["error"] = f"timeout: {exc}"
        return rec
    except (OSError, http.client.HTTPException, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"
        return rec
    finally:
        conn.close()
    rec["latency"] = time.monotonic() - start
    if not chunks or not done:
        rec["error"] = "the stream ended before [DONE]" if chunks else "no chunk in the stream"
        return rec
    meta = chunks[-1].get("meta_info") or {}
    rec["output_ids"] = assemble(chunks, meta)
    if rec["output_ids"] is None:
        rec["error"] = "streamed output_ids add up neither as deltas nor as the whole answer"
        return rec
    if len(rec["output_ids"]) != max_new_tokens:   # ignore_eos: always max_new_tokens
        rec["error"] = f"{len(rec['output_ids'])} tokens, asked for {max_new_tokens}"
        return rec
    rec.update(hits(meta))
    rec["outcome"] = "ok"
    return rec


def assemble(chunks: list[dict], meta: dict) -> list[int] | None:
    """The answer's token ids from its stream: cumulative chunks (SGLang's default) end
    with the whole answer, incremental ones add up to it; `completion_tokens` decides."""
    want = meta.get("completion_tokens")
    last = list(chunks[-1].get("output_ids") or [])
    joined = [t for c in chunks for t in (c.get("output_ids") or [])]
    if want is None:
        return last
    if len(last) == want:
        return last
    if len(joined) == want:
        return joined
    return None


def burst_owner(elapsed: float, period: float, live: list[str]) -> str | None:
    """The server whose burst window this is: live shared servers in turn, `period` s each."""
    if not live:
        return None
    return live[int(elapsed // period) % len(live)]


def answers_since(events: list[dict], server: str, t: float) -> dict:
    """A server's load answers (not solo) since journal time t."""
    out = {"ok": 0, "differ": 0, "errors": 0, "host_tokens": 0}
    for e in events:
        if e.get("type") == "request" and e["server"] == server and e["t"] >= t and e["role"] != "solo":
            if e["outcome"] == "ok":
                out["ok"] += 1
                out["differ"] += e.get("match") is False
                out["host_tokens"] += e.get("host", 0)
            elif e["outcome"] == "error" and not e.get("expected_error"):
                out["errors"] += 1
    return out


class Load:
    """Requests and clients over a fleet (fleet.Fleet), one catalogue per model.

    opts: seed, max_new_tokens, request_timeout, abort_rate, clients, burst_clients,
    burst_period (the soak's options)."""

    def __init__(self, fleet, catalogues: dict[str, Catalogue], opts):
        self.fleet, self.catalogues, self.opts = fleet, catalogues, opts
        self.reference: dict[tuple[str, str], list[int]] = {}   # (model, key) -> solo answer
        self.counts = {"ok": 0, "mismatch": 0, "error": 0, "host": 0}
        self.count_lock = threading.Lock()

    def reset_counts(self) -> None:
        with self.count_lock:
            self.counts = dict.fromkeys(self.counts, 0)

    def snapshot(self) -> dict:
        with self.count_lock:
            return dict(self.counts)

    def request(self, server, role: str, key: str, abort_after: float | None = None) -> dict:
        cat = self.catalogues[server.case.name]
        gen = server.generation
        with server.lock:
            server.inflight += 1
        try:
            rec = stream_generate(server.base, cat.prompts[key].ids, self.opts.max_new_tokens,
                                  self.opts.request_timeout, abort_after)
        finally:
            with server.lock:
                server.inflight -= 1
        rec = {"type": "request", "role": role, "server": server.label, "model": server.case.name, "key": key,
               "generation": gen, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}}
        if rec["outcome"] == "error" and (server.expect_exit or gen != server.generation or not server.up.is_set()):
            rec["expected_error"] = True      # lost to a kill of its server
        ref = self.reference.get((server.case.name, key))
        if rec["outcome"] == "ok" and ref is not None:
            rec["match"] = rec["output_ids"] == ref
        if role != "solo":
            with self.count_lock:
                if rec["outcome"] == "ok":
                    self.counts["ok"] += 1
                    self.counts["host"] += rec.get("host", 0)
                    self.counts["mismatch"] += rec.get("match") is False
                elif rec["outcome"] == "error" and not rec.get("expected_error"):
                    self.counts["error"] += 1
        self.fleet.journal.write(rec)
        return rec

    def solo(self, server) -> None:
        """Each catalogue prompt of the server's model answered alone: the references."""
        for key in self.catalogues[server.case.name].prompts:
            if self.fleet.stopping.is_set():
                return
            rec = self.request(server, "solo", key)
            if rec["outcome"] == "ok":
                self.reference.setdefault((server.case.name, key), rec["output_ids"])

    def client(self, server, role: str, index: int, burst: bool, window: tuple[int, int], t0: float) -> None:
        """One client: sessions until the phase stops; a burst client only in its server's
        burst window (window: this server's index and the number of windows)."""
        rng = random.Random(f"{self.opts.seed}/{server.case.name}/{index}")
        cat = self.catalogues[server.case.name]
        stop = self.fleet.phase_stop
        mine, count = window
        while not stop.is_set():
            if burst and role != "shared":
                if int((time.time() - t0) // self.opts.burst_period) % count != mine:
                    stop.wait(0.2)
                    continue
            if burst and role == "shared" and self.fleet.boosted != server.label:
                stop.wait(0.2)
                continue
            if not server.up.is_set() or server.paused.is_set():
                stop.wait(0.2)
                continue
            for key in session(cat, rng):
                if stop.is_set() or not server.up.is_set() or server.paused.is_set():
                    break
                abort = rng.uniform(0.02, 0.3) if rng.random() < self.opts.abort_rate else None
                self.request(server, role, key, abort)
                time.sleep(rng.uniform(0, 0.05))

    def run_clients(self, plan: list[tuple], seconds: float, extra=None) -> None:
        """Clients on each (server, role, window) of the plan for `seconds`; extra(t0) runs
        once they started."""
        stop = self.fleet.phase_stop
        stop.clear()
        t0 = time.time()
        threads = []
        for server, role, window in plan:
            for i in range(self.opts.clients + self.opts.burst_clients):
                threads.append(threading.Thread(target=self.client, daemon=True,
                                                args=(server, role, i, i >= self.opts.clients, window, t0)))
        for t in threads:
            t.start()
        if extra:
            extra(t0)
        stop.wait(max(0.0, seconds - (time.time() - t0)))
        stop.set()
        for t in threads:
            t.join(timeout=self.opts.request_timeout + 5)
