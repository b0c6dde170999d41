"""Sharing traffic: fixed token-id prompts, the phases' arrival schedules, and a streaming
client of the kind of SGLang's bench_serving (async over HTTP, POST /generate with
`input_ids` and stream on, greedy, ignore_eos), which records for every request its send
time, time to first token, inter-token latencies, output tokens and the cached tokens
SGLang's answer reports (meta_info: cached_tokens_details' device and host, num_retractions).

Prompts (`build_catalogue`): a model's traffic is multi-turn conversations on shared system
prefixes: `groups` prefixes, `conversations` on each, `turns` each; turn t is the prefix,
every earlier turn's user part and its fixed reply, and its own user part, so it extends
turn t-1's prompt. Token ids are drawn from a seeded generator: the same prompts for every
variant and round. The working set (Plan.working_set) is over a model's static share.

Arrivals (`arrivals`): open loop, a seeded Poisson process whose rate follows the phase
(`rate`): bursts (the models in turn, one window each, the others at idle_rate), waves
(each model ramping up and down, the models shifted by 1/n of a cycle) or even (every model
at even_rate). Each arrival takes the next turn of a conversation picked at random. Fixed
by the seed: the same schedule and prompts in every round and variant.

The correctness sample (`sample_sequence`): prompts of their own, prefixes asked in turn and
then again with another question, sent one at a time (`solo`): after the first pass a
prefix comes back from the device or, evicted, from host.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

from harness.sharing.plan import Plan
from harness.soak.traffic import assemble, hits, stream_event


@dataclass(frozen=True)
class Catalogue:
    prompts: dict[str, tuple[int, ...]]
    conversations: list[list[str]]         # each conversation's prompt keys, turn by turn


def _ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def build_catalogue(plan: Plan, vocab: int, seed: str) -> Catalogue:
    rng = random.Random(f"catalogue/{seed}")
    prompts, conversations = {}, []
    for g in range(plan.groups):
        prefix = _ids(rng, vocab, plan.prefix_tokens)
        for c in range(plan.conversations):
            history, keys = list(prefix), []
            for t in range(plan.turns):
                history += _ids(rng, vocab, plan.user_tokens)
                key = f"g{g}c{c}t{t}"
                prompts[key] = tuple(history)
                keys.append(key)
                history += _ids(rng, vocab, plan.reply_tokens)
            conversations.append(keys)
    return Catalogue(prompts, conversations)


def sample_sequence(plan: Plan, vocab: int, seed: str) -> list[tuple[str, tuple[int, ...]]]:
    """The sample's prompts in the order they are sent: every prefix with its first
    question, then every prefix with its second, ..."""
    rng = random.Random(f"sample/{seed}")
    prefixes = [_ids(rng, vocab, plan.sample_prefix_tokens) for _ in range(plan.sample_groups)]
    return [(f"s{g}q{q}", tuple(prefixes[g] + _ids(rng, vocab, plan.sample_question_tokens)))
            for q in range(plan.sample_questions) for g in range(plan.sample_groups)]


def rate(plan: Plan, phase: str, index: int, n: int, t: float) -> float:
    """Requests/s of model `index` of `n` at t seconds into the phase."""
    if phase == "even":
        return plan.even_rate
    if phase == "bursts":
        window = plan.phase_s / plan.windows
        return plan.burst_rate if int(t // window) % n == index else plan.idle_rate
    if phase == "waves":
        x = (t * plan.wave_cycles / plan.phase_s + index / n) % 1.0
        return plan.idle_rate + (plan.wave_rate - plan.idle_rate) * (1.0 - abs(2.0 * x - 1.0))
    raise ValueError(f"no phase {phase!r}")


def arrivals(plan: Plan, phase: str, index: int, n: int, catalogue: Catalogue, seed: str,
             duration: float | None = None) -> list[tuple[float, str]]:
    """(seconds into the phase, prompt key) of model `index`'s requests: a Poisson process
    at the phase's top rate, thinned to `rate` (Lewis-Shedler)."""
    duration = plan.phase_s if duration is None else duration
    rng = random.Random(f"arrivals/{seed}/{phase}")
    top = {"even": plan.even_rate, "bursts": max(plan.burst_rate, plan.idle_rate),
           "waves": max(plan.wave_rate, plan.idle_rate)}[phase]
    if top <= 0:
        return []
    turn = [0] * len(catalogue.conversations)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(top)
        if t >= duration:
            return out
        if rng.random() * top >= rate(plan, phase, index, n, t):
            continue
        c = rng.randrange(len(catalogue.conversations))
        keys = catalogue.conversations[c]
        out.append((round(t, 4), keys[turn[c] % len(keys)]))
        turn[c] += 1


# ---- the client --------------------------------------------------------------------------

async def generate(session, base: str, ids, max_new_tokens: int, timeout: float) -> dict:
    """One streamed greedy request: outcome ("ok" or "error" with `error`), ttft (s),
    itl_ms (one per token after the first chunk's, a chunk's gap split evenly among its
    tokens, as bench_serving does), latency (s), out (tokens), output_ids, the hit tokens
    (cached, device, host) and retractions of its meta_info."""
    import aiohttp

    body = {"input_ids": list(ids), "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    rec: dict = {"outcome": "error", "ttft": None}
    start = time.monotonic()
    chunks, itl, count, last, done = [], [], 0, start, False
    try:
        async with session.post(base + "/generate", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            async for raw in resp.content:
                kind, chunk = stream_event(raw)
                if kind == "error":
                    rec["error"] = chunk
                    return rec
                if kind == "done":
                    done = True
                    break
                if kind == "skip":
                    continue
                now = time.monotonic()
                meta = chunk.get("meta_info") or {}
                total = meta.get("completion_tokens", len(chunk.get("output_ids") or []))   # cumulative ids
                if total > count:
                    if rec["ttft"] is None:
                        rec["ttft"] = now - start
                    else:
                        itl += [round(1000 * (now - last) / (total - count), 3)] * (total - count)
                    count, last = total, now
                chunks.append(chunk)
    except asyncio.TimeoutError:
        rec["error"] = f"no answer within {timeout:g} s"
        return rec
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
        return rec
    rec["latency"] = time.monotonic() - start
    if not chunks or not done:
        rec["error"] = "the stream ended before [DONE]" if chunks else "no chunk in the stream"
        return rec
    meta = chunks[-1].get("meta_info") or {}
    output = assemble(chunks, meta)
    if output is None or len(output) != max_new_tokens:
        rec["error"] = f"{'no' if output is None else len(output)} tokens, asked for {max_new_tokens}"
        return rec
    rec.update(outcome="ok", itl_ms=itl, out=len(output), output_ids=output, **hits(meta),
               retractions=int(meta.get("num_retractions") or 0))
    return rec


def _session():
    """One connection a request, as SGLang's bench_serving opens one session a request: a
    pooled keep-alive connection that the server closed while idle fails the next request
    sent on it (ServerDisconnectedError), which is the client's doing, not the server's."""
    import aiohttp

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True), read_bufsize=1 << 20)


def _rounded(rec: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}


async def run_phase(bases: dict[str, str], schedules: dict[str, list[tuple[float, str]]],
                    catalogues: dict[str, Catalogue], plan: Plan, record, tags: dict) -> dict:
    """Every model's arrivals against its server (bases: label -> URL), each request
    journaled through record() as it ends; requests still running drain_s after the last
    arrival are cut (journaled "cut"). Returns the phase's duration (s: its start to its
    last answer), arrivals and cut requests per model."""
    cut: dict[str, int] = dict.fromkeys(bases, 0)
    async with _session() as session:
        start = time.monotonic()

        async def one(label: str, offset: float, key: str) -> None:
            ids, sent = catalogues[label].prompts[key], None
            try:
                await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
                sent = round(time.monotonic() - start, 4)
                rec = await generate(session, bases[label], ids, plan.max_new_tokens, plan.request_timeout_s)
            except asyncio.CancelledError:
                cut[label] += 1
                record({"type": "request", **tags, "model": label, "key": key, "sched": offset, "sent": sent,
                        "in": len(ids), "outcome": "cut"})
                raise
            rec.pop("output_ids", None)
            record({"type": "request", **tags, "model": label, "key": key, "sched": offset, "sent": sent,
                    "in": len(ids), **_rounded(rec)})

        tasks = [asyncio.create_task(one(label, off, key)) for label, sched in schedules.items() for off, key in sched]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=plan.phase_s + plan.drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        duration = time.monotonic() - start
    return {"duration": round(duration, 4), "arrivals": {k: len(v) for k, v in schedules.items()}, "cut": cut}


async def solo(base: str, sequence: list[tuple[str, tuple[int, ...]]], plan: Plan, record, tags: dict,
               background: dict | None = None) -> dict:
    """The sample's prompts one at a time against one server, each journaled with its
    answer; `background` ({label: (base, schedule, catalogue)}): other servers under load
    meanwhile (not journaled), until the last prompt is answered."""
    async with _session() as session:
        load, sent = [], 0
        if background:
            start = time.monotonic()

            async def one(base_bg: str, offset: float, ids) -> None:
                await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
                await generate(session, base_bg, ids, plan.max_new_tokens, plan.request_timeout_s)

            load = [asyncio.create_task(one(b, off, cat.prompts[key]))
                    for b, sched, cat in background.values() for off, key in sched]
        for key, ids in sequence:
            rec = await generate(session, base, ids, plan.sample_new_tokens, plan.request_timeout_s)
            record({"type": "request", **tags, "key": key, "in": len(ids), **_rounded(rec)})
            sent += 1
        done = sum(t.done() for t in load)
        for task in load:
            task.cancel()
        await asyncio.gather(*load, return_exceptions=True)
    return {"sent": sent, "background_answered": done}
