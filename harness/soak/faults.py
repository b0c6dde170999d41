"""The soak's faults: what each does to a shared server and what it records of what followed.

  small-host-pool   the last shared server runs --small-host-ratio (its host pool smaller
                    than its model's catalogue), recorded when the shared phase begins;
  disconnects       8 clients that hang up mid-stream; the server must go on answering;
  flush-under-load  /flush_cache while clients send (SGLang refuses while busy), then the
                    clients paused, in-flight requests drained and /flush_cache?timeout=10;
                    answers must follow;
  kill-9            SIGKILL to the whole server, its shared-memory segments removed (kvctl
                    delete does the same); the survivors' requests must not fail (with
                    the arbiter, their kvcached limits must rise: it gives them the killed
                    one's share; with fixed limits their KV pools are held at what they
                    map until the restart is up, so that what it freed is its restart's,
                    and their Mamba pools keep their limits); the server
                    is restarted and must be ready again (its fixed limit written again,
                    the same bytes).
Each runs in its own thread at its time in the shared phase (`plan_faults`) and journals
one "fault" event: when, on which server, `ok` and why not, and what followed.
"""
from __future__ import annotations

import random
import threading
import time
import urllib.error

from harness.soak import kvc, traffic, verdict


def plan_faults(duration: float, shared: list[str]) -> list[dict]:
    """When each fault of the shared phase starts (seconds into it) and on which server.
    The kill takes the second shared server (the first stays up through everything), the
    drained flush and the disconnects the first."""
    first, second = shared[0], shared[1 % len(shared)]
    return [
        {"at": round(0.15 * duration, 1), "kind": "disconnects", "server": first},
        {"at": round(0.25 * duration, 1), "kind": "flush-under-load", "server": first},
        {"at": round(0.40 * duration, 1), "kind": "kill-9", "server": second},
    ]


class Faults:
    """The faults of one shared phase over a fleet, its load and its budget (kvc.Budget).

    opts: seed, duration, restart_timeout (the soak's options)."""

    def __init__(self, fleet, load: traffic.Load, budget: kvc.Budget, opts):
        self.fleet, self.load, self.budget, self.opts = fleet, load, budget, opts
        self.done: list[dict] = []

    def record(self, event: dict) -> dict:
        self.done.append(self.fleet.journal.write({"type": "fault", **event}))
        return event

    def small_host_pool(self, server, host_tokens: int, catalogue_tokens: int) -> None:
        ok = host_tokens < catalogue_tokens
        self.record({"kind": "small-host-pool", "server": server.label, "at": 0,
                     "detail": {"hicache_ratio": self.opts.small_host_ratio, "host_tokens": host_tokens,
                                "catalogue_tokens": catalogue_tokens},
                     "ok": ok, "why": "" if ok else
                     f"host pool ({host_tokens} tokens) holds the whole catalogue ({catalogue_tokens}): not too small"})

    def run(self, f: dict) -> None:
        """One fault at its time (its own thread), recorded with what followed it."""
        fleet = self.fleet
        delay = fleet.shared_t0 + f["at"] - time.time()
        if fleet.phase_stop.wait(max(0.0, delay)) or fleet.stopping.is_set():
            fleet.journal.write({"type": "fault", "kind": f["kind"], "server": f["server"], "at": f["at"],
                                 "ok": None, "why": "not reached: the phase ended first"})
            return
        server = fleet.servers[f["server"]]
        fleet.journal.write({"type": "fault-begin", "kind": f["kind"], "server": server.label})
        action = {"disconnects": self.disconnects, "flush-under-load": self.flush_under_load,
                  "kill-9": self.kill_nine}[f["kind"]]
        try:
            rec = action(server)
        except Exception as exc:   # the run goes on; the fault says what broke
            rec = {"ok": False, "why": f"{type(exc).__name__}: {exc}"}
        self.record({"kind": f["kind"], "server": server.label, "at": f["at"], **rec})

    def observe(self) -> float:
        """Seconds to watch what follows a fault: a tenth of the phase, 3 to 10."""
        return min(10.0, max(3.0, self.opts.duration / 10))

    def answers_since(self, server: str, t: float) -> dict:
        return traffic.answers_since(verdict.read_journal(self.fleet.journal.path), server, t)

    def disconnects(self, server) -> dict:
        t = self.fleet.journal.now()
        rng = random.Random(self.opts.seed)
        keys = list(self.load.catalogues[server.case.name].prompts)
        recs = []
        threads = [threading.Thread(target=lambda k=k, a=a: recs.append(self.load.request(server, "shared", k, a)))
                   for k, a in ((rng.choice(keys), rng.uniform(0.01, 0.2)) for _ in range(8))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        self.fleet.phase_stop.wait(self.observe())
        after = self.answers_since(server.label, t)
        alive = server.running()
        return {"detail": {"sent": 8, "aborted": sum(r["outcome"] == "aborted" for r in recs)},
                "followed": {"server_alive": alive, **after},
                "ok": alive and after["ok"] > 0 and not after["errors"],
                "why": "" if alive and after["ok"] else "the server stopped answering after clients hung up"}

    def flush_under_load(self, server) -> dict:
        t = self.fleet.journal.now()
        before = self.answers_since(server.label, max(0, t - self.observe()))
        under = self.flush(server)
        server.paused.set()
        deadline = time.time() + 30
        while server.inflight and time.time() < deadline:
            time.sleep(0.05)
        # SGLang flushes only when idle: with a timeout it waits for that (a request a client
        # hung up on may still be running) instead of refusing at once
        drained = self.flush(server, wait_s=10)
        server.paused.clear()
        t_after = self.fleet.journal.now()
        self.fleet.phase_stop.wait(self.observe())
        after = self.answers_since(server.label, t_after)
        ok = drained.get("status") == 200 and after["ok"] > 0 and not after["errors"]
        return {"detail": {"under_load": under, "drained": drained, "observed_s": self.observe()},
                "followed": {"before": before, "after": after},
                "ok": ok, "why": "" if ok else "flush after draining did not succeed, or the server did not answer after it"}

    def flush(self, server, wait_s: float = 0) -> dict:
        t = time.time()
        try:
            body = server.post("/flush_cache" + (f"?timeout={wait_s:g}" if wait_s else ""), {}, timeout=60 + wait_s)
            return {"status": 200, "body": str(body)[:200], "s": round(time.time() - t, 3)}
        except urllib.error.HTTPError as exc:
            return {"status": exc.code, "body": exc.read().decode(errors="replace")[:200]}
        except (urllib.error.URLError, OSError) as exc:
            return {"status": None, "body": f"{type(exc).__name__}: {exc}"}

    def kill_nine(self, server) -> dict:
        fleet, budget, shm = self.fleet, self.budget, self.budget.shm_dir
        inst = budget.instance(server)
        survivors = [i for i in budget.shared if i is not inst]
        before = {i.server: kvc.read_instance(shm, i) for i in budget.shared}
        t_kill = fleet.journal.now()
        server.kill9()
        with budget.lock:               # the sampler reads these as it writes the limits
            inst.live = False
            removed = kvc.remove_segments(shm, inst.name)
            inst.wants.clear()
            # fixed: the others held at what they map until the restart is up (released below, whatever happens)
            held = budget.limits.hold(survivors) if budget.limits else {}
        try:
            fleet.journal.write({"type": "server", "event": "killed", "server": server.label, "segments_removed": removed})
            # the arbiter's limits rise at its next tick, fixed ones are held (above); watch the others' use
            peak = {i.server: 0 for i in survivors}
            peak_limit = {i.server: 0 for i in survivors}
            watch_until = time.time() + 2 * self.observe()
            while time.time() < watch_until and not fleet.stopping.is_set():
                for i in survivors:
                    c = kvc.read_instance(shm, i) or {}
                    peak[i.server] = max(peak[i.server], c.get("used", 0))
                    peak_limit[i.server] = max(peak_limit[i.server], c.get("limit", 0))
                time.sleep(0.25)
            answers = {i.server: self.answers_since(i.server, t_kill) for i in survivors}
            gained = {n: {"limit_before": (before.get(n) or {}).get("limit"), "limit_after": peak_limit[n],
                          "used_before": (before.get(n) or {}).get("used"), "used_peak_after": peak[n]}
                      for n in peak}
            server.launch(fleet.journal)
            began = time.time()
            ready = server.wait_up(fleet.journal, self.opts.restart_timeout)
            restart_s = round(time.time() - began, 1)
        finally:
            if budget.limits:
                with budget.lock:
                    budget.limits.release()
        if ready:
            inst.live = True
        grew = budget.arbiter is None or any((g["limit_after"] or 0) > (g["limit_before"] or 0)
                                             for g in gained.values())
        ok = ready and grew and all(not v["errors"] for v in answers.values())
        why = [] if ready else [f"not ready again within {self.opts.restart_timeout:.0f} s"]
        if not grew:
            why.append("no survivor's kvcached limit rose after the kill")
        why += [f"{n}: {v['errors']} failed requests after the kill" for n, v in answers.items() if v["errors"]]
        readings = budget.limits.readings if budget.limits else {}
        return {"detail": {"before": before, "segments_removed": removed, "held_bytes": held,
                           "held_segments": readings},
                "followed": {"survivors_counters": gained, "survivors_answers": answers,
                             "restart_s": restart_s, "ready_again": ready},
                "ok": ok, "why": "; ".join(why)}
