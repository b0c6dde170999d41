"""Which of sglang-kernel's compiled ops a process really ran.

A run on sglang-kernel's real ops must say which ops ran compiled and which did not. This
module is imported at the end of `sgl_kernel/__init__.py` by `setup.sh` (beside it) and,
with `SGLK_REAL_LOG` set, replaces every op of the `sgl_kernel` torch namespace that the
import registered with a counting proxy: the first call of each op in each process
appends `<pid> <op>` to that file (O_APPEND writes of one short line, so processes of one
server may share it). It records at the op level, so a call through sglang-kernel's
Python wrappers (`torch.ops.sgl_kernel.rmsnorm.default(...)`) and a direct call from
SGLang count alike. Ops absent from the library stay absent: SGLang's `hasattr` checks
(e.g. for `transfer_embedding_ranges_direct`, which 0.4.5 lacks) see what they would
see without this module.

`python3 sgl_kernel_calls.py --summary LOG [--stand-in-log LOG] [--out JSON]` sums the
logs of a run: the ops called (real), the ops a stand-in served (the e2e bundle's
`$SGLK_CALL_LOG`), and fails (exit 1) when any op ran on a stand-in or none was recorded.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

NAMESPACE = "sgl_kernel"


class _CountingOverload:
    """One overload (`.default`) of an op: records its first call, then calls through."""

    def __init__(self, overload, record):
        self._overload, self._record = overload, record

    def __call__(self, *args, **kwargs):
        self._record()
        return self._overload(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._overload, name)


class _CountingPacket:
    """Stands where `torch.ops.sgl_kernel.<op>` stood; every way of calling it is recorded."""

    def __init__(self, packet, name: str, log_path: str, seen: set):
        self._packet, self._name, self._log_path, self._seen = packet, name, log_path, seen

    def _record(self):
        key = (os.getpid(), self._name)   # a forked child inherits its parent's set
        if key in self._seen:
            return
        self._seen.add(key)
        line = f"{os.getpid()} {self._name}\n".encode()
        fd = os.open(self._log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def __call__(self, *args, **kwargs):
        self._record()
        return self._packet(*args, **kwargs)

    def __getattr__(self, name):
        attr = getattr(self._packet, name)
        if name in self._packet.overloads():
            return _CountingOverload(attr, self._record)
        return attr


def registered_ops(namespace: str = NAMESPACE) -> list[str]:
    """Op names the dispatcher knows under `namespace` (those loaded so far)."""
    import torch

    prefix = namespace + "::"
    names = {n[len(prefix):].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix)}
    return sorted(names)


def install(namespace: str = NAMESPACE, log_path: str | None = None) -> list[str]:
    """Wrap every registered op of `namespace`; returns the names wrapped (none without a log)."""
    log_path = log_path or os.environ.get("SGLK_REAL_LOG")
    if not log_path:
        return []
    import torch

    ops = getattr(torch.ops, namespace)
    seen: set = set()
    wrapped = []
    for name in registered_ops(namespace):
        packet = getattr(ops, name)
        if isinstance(packet, _CountingPacket):
            continue
        setattr(ops, name, _CountingPacket(packet, name, log_path, seen))
        wrapped.append(name)
    return wrapped


# sglang-kernel's Python wrappers whose norm and sampling calls go to FlashInfer when it
# imports (its JIT modules, compiled at first use from sources the carried FlashInfer
# lacks); without it they call sglang-kernel's own compiled ops
FLASHINFER_ROUTED = ("sgl_kernel.elementwise", "sgl_kernel.sampling")


def without_flashinfer() -> list[str]:
    """Send sglang-kernel's wrappers to its own compiled ops instead of FlashInfer's JIT
    ones (the `_has_flashinfer` flag each reads at call time); returns the modules changed."""
    changed = []
    for name in FLASHINFER_ROUTED:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "_has_flashinfer", False):
            module._has_flashinfer = False
            changed.append(name)
    return changed


def read_log(path: str) -> dict[str, set]:
    """op -> pids that called it, from a log of `<pid> <op>` lines (missing file: empty)."""
    calls: dict[str, set] = {}
    if not os.path.exists(path):
        return calls
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2 and parts[0].isdigit():
                calls.setdefault(parts[1], set()).add(parts[0])
    return calls


def read_stand_in_log(path: str) -> set[str]:
    """Ops a stand-in was called for, from the e2e bundle's log: `CALL-MISSING <op>` for
    an op without a body (its `DEFINE-FAIL <op>: <why>` lines are schemas, not calls)."""
    ops: set[str] = set()
    if not os.path.exists(path):
        return ops
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 2 and parts[0] == "CALL-MISSING":
                ops.add(parts[1])
            elif len(parts) == 1:   # a bare op name
                ops.add(parts[0])
    return ops


def summary(real_log: str, stand_in_log: str | None = None) -> dict:
    real = read_log(real_log)
    stand_in = read_stand_in_log(stand_in_log) if stand_in_log else set()
    return {
        "ops_called_real": sorted(real),
        "processes_per_op": {op: len(pids) for op, pids in sorted(real.items())},
        "ops_on_stand_in": sorted(stand_in),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--summary", required=True, metavar="LOG", help="the SGLK_REAL_LOG of a run")
    parser.add_argument("--stand-in-log", metavar="LOG", help="the stand-in bundle's SGLK_CALL_LOG")
    parser.add_argument("--out", metavar="JSON")
    args = parser.parse_args(argv)
    result = summary(args.summary, args.stand_in_log)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(f"sgl_kernel ops called (real): {len(result['ops_called_real'])}: {' '.join(result['ops_called_real'])}")
    print(f"sgl_kernel ops on a stand-in: {len(result['ops_on_stand_in'])}: {' '.join(result['ops_on_stand_in'])}")
    if not result["ops_called_real"]:
        print(f"no sgl_kernel op recorded in {args.summary}: the recorder did not run (was the real package "
              "imported, with SGLK_REAL_LOG set?)")
        return 1
    return 1 if result["ops_on_stand_in"] else 0


if __name__ == "__main__":
    sys.exit(main())
