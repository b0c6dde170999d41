"""Run every differential case against the SGLang tree on PYTHONPATH; write the outcomes.

    PYTHONPATH=<sglang tree>:<this repo> python -m harness.differential.runner --out FILE
    ... --device cuda --real-kernels       (on a GPU: real JIT kernels, pinned host memory)

One process runs all cases (importing SGLang takes seconds). A case is a scenario
(scenarios.py) built by SGLang's own entry point from a ServerArgs parsed from
`--enable-hierarchical-cache --hicache-mem-layout L --hicache-io-backend B`, for every
L and B the parser accepts (see publish() for the resolution it runs). Its outcome,
step by step:

  configure   the resolved layout, io backend and host size; a case that resolves as
              one already run is recorded as `same_as` it and stops here
  device_pools
              the scenario's device pools (SGLang's classes), filled with random bytes
  construct   the entry point's result or exception; every tensor's shape, strides and
              storage, every storage's sha256 and pointer table, every scalar attribute
              of every host and device pool, the group and the controller
  trip<n>.write / trip<n>.load
              a backup of random device pages (and Mamba slots, SWA rows, sidecars)
              through the controller, then a load into pages it allocates; hashes after
  storage.<pool>.*
              get_data_page, get_dummy_flat_data_page, set_from_flat_data_page (the L3
              storage path) and the storage metadata methods each host pool has
  final       every state again, then destroy.<pool>: each host pool's destroy()

Device buffers start random and host buffers poisoned (seeded per case), so a copy that
moves other bytes than on the other tree changes a hash. A step that raises records
its exception (type and message) and the case goes on. Also recorded: which builders,
strategies and host-pool classes the case reached (the coverage check's evidence).
"""
from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import logging
import os
import random
import sys
import time
import traceback
import zlib
from collections import namedtuple
from types import SimpleNamespace

import torch

from harness.differential import kernels, probe
from harness.differential.entry import build, publish
from harness.differential.scenarios import SCENARIOS, Context
from harness.differential.steps import TRIPS, Trip, describe, pool_roots, storage_steps

LAYOUT_FLAG, IO_FLAG = "hicache_mem_layout", "hicache_io_backend"
# host_memory_budget_bytes() reads psutil's free memory, which differs between two runs
# (and is in the refusal's message): both trees see this one.
HOST_MEMORY_AVAILABLE = 256 << 30
ASSEMBLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"


# --------------------------------------------------------------------------- process

def pin_host_memory_report():
    import psutil

    fields = psutil.virtual_memory()._fields
    values = {name: 0 for name in fields}
    values.update(total=HOST_MEMORY_AVAILABLE, available=HOST_MEMORY_AVAILABLE)
    report = namedtuple("svmem", fields)(**values)
    psutil.virtual_memory = lambda: report


class Reach:
    """Records the builders, strategies and host-pool classes a case runs (wrappers
    around SGLang's functions: they record the name and call through)."""

    def __init__(self):
        self.names: set[str] = set()

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.names.add(name)
            return fn(*args, **kwargs)
        return wrapper

    def install(self):
        import importlib
        import inspect

        assembler = importlib.import_module(ASSEMBLER)
        for name, value in list(vars(assembler).items()):
            if inspect.isfunction(value) and value.__module__ == ASSEMBLER and not name.startswith("_"):
                setattr(assembler, name, self._wrap(name, value))
            elif (inspect.isclass(value) and value.__module__ == ASSEMBLER
                  and issubclass(value, assembler.StackStrategy) and value is not assembler.StackStrategy):
                value.build = self._wrap(name, value.build)
        for cls in self._host_pool_classes():
            if "__init__" in vars(cls):
                cls.__init__ = self._wrap_init(cls.__init__)

    def _wrap_init(self, init):
        @functools.wraps(init)
        def wrapper(obj, *args, **kwargs):
            self.names.add(type(obj).__name__)
            return init(obj, *args, **kwargs)
        return wrapper

    @staticmethod
    def _host_pool_classes():
        import importlib
        import pkgutil

        from sglang.srt.mem_cache import pool_host
        from sglang.srt.mem_cache.pool_host import HostKVCache

        for info in pkgutil.iter_modules(pool_host.__path__):
            importlib.import_module(f"{pool_host.__name__}.{info.name}")
        importlib.import_module("sglang.srt.mem_cache.memory_pool_host")
        todo, found = [HostKVCache], []
        while todo:
            for sub in todo.pop().__subclasses__():
                if sub not in found:
                    found.append(sub)
                    todo.append(sub)
        return found

    def take(self) -> list[str]:
        names, self.names = sorted(self.names), set()
        return names


# --------------------------------------------------------------------------- cases

def parser_choices() -> dict[str, list[str]]:
    return {LAYOUT_FLAG: _action("--hicache-mem-layout").choices, IO_FLAG: _action("--hicache-io-backend").choices}


def parser_defaults() -> dict[str, str]:
    return {LAYOUT_FLAG: _action("--hicache-mem-layout").default, IO_FLAG: _action("--hicache-io-backend").default}


@functools.cache
def _parser():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def _action(flag: str):
    for action in _parser()._actions:
        if flag in action.option_strings:
            return SimpleNamespace(choices=list(action.choices), default=action.default)
    raise KeyError(f"SGLang's parser has no {flag}")


def case_ids(selected: str | None) -> list[tuple[str, object, str, str]]:
    """Every scenario with every host layout and io backend SGLang's parser accepts
    (flag variants: with its defaults)."""
    choices, defaults = parser_choices(), parser_defaults()
    cases = []
    for scenario in SCENARIOS:
        layouts = [defaults[LAYOUT_FLAG]] if scenario.sizes_only else choices[LAYOUT_FLAG]
        ios = [defaults[IO_FLAG]] if scenario.sizes_only else choices[IO_FLAG]
        for layout in layouts:
            for io in ios:
                case = f"{scenario.name}/{layout}+{io}"
                if selected is None or fnmatch.fnmatch(case, selected):
                    cases.append((case, scenario, layout, io))
    return cases


# --------------------------------------------------------------------------- steps

class Case:
    def __init__(self, case_id, scenario, layout, io, device, trees, seen):
        self.id, self.scenario, self.layout, self.io = case_id, scenario, layout, io
        self.seen = seen  # resolved configuration -> the case that ran it
        self.device, self.trees = device, trees
        seed = zlib.crc32(case_id.encode())
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.steps, self.debug = [], {}
        self.roots: dict[str, object] = {}
        self.storage_same_as = None

    def record(self, name, fn, *, state=True, layout=False):
        """Run one step; record its result (or exception) and, for a step that may
        write (state=True), the state after it. A read-only step that wrote anyway
        shows in the next state recorded (at the latest the final one)."""
        entry = {"step": name}
        started = time.monotonic()
        try:
            result = fn()
            if result is not None:
                entry["result"] = result
        except Exception as error:  # recorded, compared, and the case goes on
            entry["error"] = {"type": type(error).__name__,
                              "message": probe.clean_message(str(error), self.trees)}
            if needs_missing_aot_op(error):
                entry["not_run"] = "needs an sgl_kernel (AOT) op this machine does not have"
            self.debug[name] = probe.clean_message(traceback.format_exc(limit=-4), self.trees)
            if self.device == "cuda":  # a sticky CUDA error may kill the runner before --out is written
                print(f"{self.id} {name}: {self.debug[name]}", file=sys.stderr, flush=True)
        if self.roots and state:
            entry["state"] = probe.snapshot(self.roots, layout=layout, hashes=not self.scenario.sizes_only)
        self.debug.setdefault("seconds", {})[name] = round(time.monotonic() - started, 3)
        self.steps.append(entry)
        return "error" not in entry

    def run(self):
        flags = ["--hicache-mem-layout", self.layout, "--hicache-io-backend", self.io, *self.scenario.flags]
        outcome = {"id": self.id, "flags": flags}
        holder = {}

        def configure():
            holder["args"] = publish(flags)
            from sglang.srt.runtime_context import get_memory

            memory = get_memory()
            return {"layout": memory.hicache_mem_layout, "io_backend": memory.hicache_io_backend,
                    "hicache_size": memory.hicache_size, "hicache_ratio": memory.hicache_ratio}

        same_as = None
        if self.record("configure", configure):
            resolved = json.dumps([self.scenario.name, self.steps[0]["result"]])
            same_as = self.seen.get(resolved)
            if same_as is None:
                self.seen[resolved] = self.id
                self.build(holder["args"])
        outcome["steps"] = self.steps  # first: a difference in a step is reported before its consequences
        if same_as:
            outcome["same_as"] = same_as
        if self.storage_same_as:
            outcome["storage_same_as"] = self.storage_same_as
        outcome["debug"] = self.debug
        return outcome

    def build(self, server_args):
        from sglang.srt.runtime_context import get_parallel

        ctx = Context(device=self.device, rng=self.rng)
        built = {}

        def device_pools():
            with get_parallel().override(**self.scenario.parallel):
                built["pools"] = self.scenario.pools(ctx)
            return type(built["pools"].kvcache).__name__

        if not self.record("device_pools", device_pools):
            return
        pools = built["pools"]
        device_roots = {"device": pools.kvcache}
        for i, pool in enumerate((*pools.mtp_draft_device_pools, *pools.draft_device_pools)):
            device_roots[f"draft{i}"] = pool
        if pools.req_to_token_pool is not None:
            device_roots["mamba"] = pools.req_to_token_pool.mamba_pool
        probe.fill(device_roots, self.generator)

        def construct():
            with get_parallel().override(**self.scenario.parallel):
                built["group"], built["controller"], built["sidecars"] = build(self.scenario, pools, server_args)
            return describe(built["group"], built["controller"])

        ok = self.record("construct", construct)
        if not ok:
            self.roots = {}
            return
        group, controller = built["group"], built["controller"]
        self.roots = {**device_roots, **pool_roots(group), "group": group, "controller": controller}
        if self.scenario.sizes_only:
            self.steps[-1]["state"] = probe.snapshot(self.roots, layout=True, hashes=False)
            self.record("final", lambda: None, layout=True)
            return self.release(group)
        probe.fill({name: root for name, root in self.roots.items() if name.endswith(".host")}, self.generator)
        self.steps[-1]["state"] = probe.snapshot(self.roots, layout=True)
        trips = [Trip(self, group, controller, built["sidecars"], pools) for _ in range(TRIPS)]
        for n, trip in enumerate(trips, 1):
            if not self.record(f"trip{n}.write", trip.write):
                break
            self.record(f"trip{n}.load", trip.load)
        # Host pools get no io backend: their storage path depends on the host layout
        # alone, so it runs in the first case of each scenario and layout.
        storage_key = json.dumps([self.scenario.name, self.steps[0]["result"]["layout"]])
        if storage_key in self.seen:
            self.storage_same_as = self.seen[storage_key]
        else:
            self.seen[storage_key] = self.id
            host_page = trips[0].host_page if trips[0].host is not None else 0
            for entry in group.entries:
                storage_steps(self, entry, host_page)
        self.record("final", lambda: None, layout=True)
        self.release(group)

    def release(self, group):
        """destroy() every host pool, as SGLang does at exit: on a GPU it unregisters
        the pinned host memory, which the next case may be handed again."""
        roots, self.roots = self.roots, {}
        for entry in group.entries:
            if hasattr(entry.host_pool, "destroy"):
                self.record(f"destroy.{entry.name}", entry.host_pool.destroy)
        self.roots = roots


def needs_missing_aot_op(error) -> bool:
    """A step that reached an sgl_kernel op where sglang-kernel is not installed: the
    GPU variant's machine has an import stand-in whose ops raise NotImplementedError
    naming sgl_kernel (the CPU variant emulates every op SGLang imports)."""
    return isinstance(error, NotImplementedError) and "sgl_kernel" in str(error)


# --------------------------------------------------------------------------- main

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the outcomes, one JSON document")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--real-kernels", action="store_true",
                        help="run SGLang's real kernels (needs --device cuda); default: CPU emulation")
    parser.add_argument("--case", help="only cases whose id matches this glob")
    args = parser.parse_args(argv)
    if args.real_kernels != (args.device == "cuda"):
        parser.error("--real-kernels goes with --device cuda, the emulation with --device cpu")
    started = time.monotonic()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the "dummy" model must never be looked up
    import sglang

    logging.disable(logging.CRITICAL)  # SGLang logs every pool it builds; outcomes are in --out
    # The two trees' runners share the machine: one thread each (torch's intra-op
    # threads only contend for the same cores on these small tensors).
    torch.set_num_threads(1)

    tree = os.path.dirname(os.path.dirname(os.path.abspath(sglang.__file__)))
    pin_host_memory_report()
    kernels_note = kernels.real() if args.real_kernels else "emulated (harness/emulation/__init__.py)"
    if not args.real_kernels:
        kernels.emulate()
    reach = Reach()
    reach.install()
    outcomes, seen = [], {}
    for case_id, scenario, layout, io in case_ids(args.case):
        outcome = Case(case_id, scenario, layout, io, args.device, (tree,), seen).run()
        if args.real_kernels:
            kernels.release_host_memory()
        outcome["reached"] = reach.take()
        outcomes.append(outcome)
    not_run = sum(1 for case in outcomes for step in case["steps"] if "not_run" in step)
    document = {"sglang": tree, "device": args.device, "kernels": kernels_note, "choices": parser_choices(),
                "steps": sum(len(case["steps"]) for case in outcomes), "steps_not_run": not_run,
                "defaults": parser_defaults(),
                "flag_variants": [scenario.name for scenario in SCENARIOS if scenario.sizes_only],
                "seconds": round(time.monotonic() - started, 1), "cases": outcomes}
    with open(args.out, "w") as handle:
        json.dump(document, handle)
    print(f"{len(outcomes)} cases, {document['steps']} steps ({not_run} not run: no sgl_kernel op) "
          f"in {document['seconds']} s -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
