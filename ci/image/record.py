#!/usr/bin/env python3
"""The record of a `make image` build, and the check that it is of the series as it is.

    make image ... | ci/image/record.py stamp            each line prefixed with the build's
                                                          elapsed seconds, "[+  12.3s] "
    ci/image/record.py write [--log L] [--tag T] [--out R] after the build: the record (make
                                                          image: R = IMAGE_RECORD, build/...)
    ci/image/record.py check [R]                          exit 1 when R's series digest is
                                                          not patches/' (make lint runs it)

The record (the committed one: ci/image/record.json) says what was built and how: the engine and its
version, the base image, the image's id and size, each Dockerfile step's time (from the
stamped log), what ran inside (the CPU tier's closing line and scripts/status's), the
commit and the series digest the image holds. docs/image.md describes the image from it,
so `check` keeps the docs from describing an image of another series.
Exit status: 0 ok, 1 a check failed, 2 bad input (one line).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "ci" / "image" / "record.json"
STAMP = re.compile(r"^\[\+\s*(\d+(?:\.\d+)?)s\] (.*)$")
STEP = re.compile(r"^(?:STEP|Step) (\d+)/(\d+)\s*:\s*(.*)$")


def series_digest() -> dict:
    """The digest scripts/apply records for patches/ (scripts/_series.py, loaded from its
    file as harness.project does: scripts/ is a folder of commands, not a package)."""
    spec = importlib.util.spec_from_file_location("_series", ROOT / "scripts" / "_series.py")
    series_lib = importlib.util.module_from_spec(spec)
    sys.modules["_series"] = series_lib  # its dataclasses look their module up by name
    spec.loader.exec_module(series_lib)
    series = series_lib.Series(ROOT / "patches")
    return {"patches": f"0001-{len(series.patches):04d}", "digest": series.digest}


def stamp() -> int:
    start = time.monotonic()
    for line in sys.stdin:
        sys.stdout.write(f"[+{time.monotonic() - start:7.1f}s] {line}")
        sys.stdout.flush()
    return 0


def steps(lines: list[str]) -> list[dict]:
    """Each Dockerfile step with the seconds until the next one (or the log's end)."""
    found, last = [], 0.0
    for line in lines:
        m = STAMP.match(line)
        if not m:
            continue
        last, text = float(m.group(1)), m.group(2)
        s = STEP.match(text)
        if s:
            found.append({"step": int(s.group(1)), "of": int(s.group(2)), "what": s.group(3)[:120], "start": last})
    for here, after in zip(found, found[1:] + [{"start": last}]):
        here["seconds"] = round(after["start"] - here.pop("start"), 1)
    return found


def engine_output(engine: str, *args: str) -> str:
    try:
        proc = subprocess.run([engine, *args], capture_output=True, text=True)
    except OSError as err:
        proc = subprocess.CompletedProcess([engine], 127, "", str(err))
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        print(f"error: {engine} {' '.join(args)}: {why}", file=sys.stderr)
        raise SystemExit(2)
    return proc.stdout.strip()


def write(log: Path, tag: str, engine: str, out: Path) -> int:
    if not log.is_file():
        print(f"error: no build log at {log} (make image writes it)", file=sys.stderr)
        return 2
    lines = log.read_text(errors="replace").splitlines()
    plain = [STAMP.sub(r"\2", line) for line in lines]
    try:
        inspect = json.loads(engine_output(engine, "image", "inspect", tag))[0]
    except (ValueError, IndexError, KeyError) as err:
        print(f"error: {engine} image inspect {tag} gave no image description ({err})", file=sys.stderr)
        return 2
    tier = [line for line in plain if re.search(r"^\d+ passed", line)]
    status = [line for line in plain if ": series applied" in line]
    base = next((m.group(1) for line in plain if (m := re.match(r"^(?:STEP|Step) 1/\d+\s*:\s*FROM (\S+)", line))),
                None)
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "engine": engine_output(engine, "--version"),
        "tag": tag,
        "image_id": inspect.get("Id"),
        "size_bytes": inspect.get("Size"),
        "base": base,
        "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() or None,
        "series": series_digest(),
        "steps": steps(lines),
        "ran_inside": {"cpu_tier": tier[-1] if tier else None, "status": status[-1] if status else None},
    }
    if not (record["ran_inside"]["cpu_tier"] and record["ran_inside"]["status"]):
        print(f"error: {log} holds no CPU tier result or no applied series: not a finished image build",
              file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}: {tag} {str(record['image_id'])[:19]}, {(record['size_bytes'] or 0) / 1e9:.2f} GB, "
          f"series {record['series']['patches']} {record['series']['digest'][:16]}")
    return 0


def check(path: Path) -> int:
    try:
        record = json.loads(path.read_text())
        recorded = record["series"]["digest"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"error: {path} is not an image record ({err})", file=sys.stderr)
        return 2
    try:
        now = series_digest()
    except Exception as err:  # the series scripts' own refusal (an edited patches/series, ...)
        print(f"error: cannot read patches/: {str(err).splitlines()[0] if str(err) else type(err).__name__}",
              file=sys.stderr)
        return 2
    if recorded != now["digest"]:
        print(f"error: {path} records an image of series {recorded[:16]}, patches/ is {now['digest'][:16]}: "
              "rebuild the image with the series as it is (make image IMAGE_RECORD=ci/image/record.json)",
              file=sys.stderr)
        return 1
    print(f"image record: series {now['patches']} {recorded[:16]}, as patches/")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("stamp")
    w = sub.add_parser("write")
    w.add_argument("--log", type=Path, default=ROOT / "build" / "image-build.log")
    w.add_argument("--tag", default=None)
    w.add_argument("--engine", default="podman")
    w.add_argument("--out", type=Path, default=ROOT / "build" / "image-record.json")
    c = sub.add_parser("check")
    c.add_argument("record", nargs="?", type=Path, default=RECORD)
    args = parser.parse_args(argv)
    if args.verb == "stamp":
        return stamp()
    if args.verb == "write":
        pin = dict(line.split("=", 1) for line in (ROOT / "sglang.pin").read_text().splitlines()
                   if "=" in line and not line.startswith("#"))
        tag = args.tag or f"sglang-elastic-hicache:{pin.get('SGLANG_VERSION', '').strip()}"
        return write(args.log, tag, args.engine, args.out)
    return check(args.record)


if __name__ == "__main__":
    sys.exit(main())
