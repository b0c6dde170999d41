#!/usr/bin/env python3
"""The pure steps of ci/image/make-base.sh: what the stand-in base installs, for which
wheel tags, and what to leave out when a requirement has no wheel for its Python.

  requirements METADATA         SGLang's unconditional Requires-Dist lines (no extras),
                                one a line, from the wheel's METADATA file
  pyproject METADATA            a pyproject.toml for the wheel's python/ tree, so that
                                pip installs it editable (name, version, Python and
                                requirements from METADATA; setuptools finds sglang*;
                                the commands, e.g. `sglang`, from the entry_points.txt
                                next to METADATA)
  platform-args GLIBC           pip's --platform flags for a glibc (e.g. 2.41): every
                                manylinux tag that glibc runs, which pip's --platform
                                does not expand by itself
  drop-unresolvable LOG REQS    read a failed `pip download` log; remove from the file
                                REQS the requirement that cannot resolve (the one named,
                                or the top-level one that pulled it in); print it

Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import configparser
import json
import re
import sys
from email.parser import Parser
from pathlib import Path

NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
NOT_FOUND = re.compile(r"^ERROR: No matching distribution found for ([A-Za-z0-9][A-Za-z0-9._-]*)")
# pip names the chain: "...requirement X==1 (from Y) (from versions: ...)".
PULLED_BY = re.compile(r"^ERROR: Could not find a version that satisfies the requirement "
                       r"([A-Za-z0-9][A-Za-z0-9._-]*)\S*(?:;[^(]*)? \(from ([A-Za-z0-9][A-Za-z0-9._-]*)")


class UsageError(Exception):
    pass


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str | None:
    m = NAME.match(line)
    return canonical(m.group(1)) if m and not line.lstrip().startswith("#") else None


def requirements(metadata: str) -> list[str]:
    """Requires-Dist lines that hold without any extra."""
    msg = Parser().parsestr(metadata)
    if not msg.get("Name") or not msg.get("Version"):
        raise UsageError("not a wheel METADATA file (no Name or Version)")
    return [r.strip() for r in msg.get_all("Requires-Dist") or [] if not re.search(r"\bextra\s*==", r)]


# entry_points.txt's groups as pyproject.toml names them (PEP 621).
SCRIPT_TABLES = {"console_scripts": "project.scripts", "gui_scripts": "project.gui-scripts"}


def pyproject(metadata: str, entry_points: str | None = None) -> str:
    msg = Parser().parsestr(metadata)
    deps = requirements(metadata)
    lines = ["# Written by ci/image/base_wheels.py from the wheel's METADATA.",
             "[build-system]", 'requires = ["setuptools>=64"]', 'build-backend = "setuptools.build_meta"', "",
             "[project]", f"name = {json.dumps(msg['Name'])}", f"version = {json.dumps(msg['Version'])}"]
    if msg.get("Requires-Python"):
        lines.append(f"requires-python = {json.dumps(msg['Requires-Python'])}")
    lines += ["dependencies = [", *(f"  {json.dumps(d)}," for d in deps), "]", "",
              "[tool.setuptools.packages.find]", f"include = [{json.dumps(msg['Name'])}, {json.dumps(msg['Name'] + '.*')}]", ""]
    if entry_points:
        parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
        parser.optionxform = str  # names are case-sensitive
        try:
            parser.read_string(entry_points)
        except configparser.Error as e:
            raise UsageError(f"not an entry_points.txt file: {e.message.splitlines()[0]}") from None
        for group in parser.sections():
            table = SCRIPT_TABLES.get(group, f"project.entry-points.{json.dumps(group)}")
            lines += [f"[{table}]", *(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in parser[group].items()), ""]
    return "\n".join(lines)


def platform_args(glibc: str, arch: str = "x86_64") -> list[str]:
    m = re.fullmatch(r"2\.(\d+)", glibc)
    if not m or int(m.group(1)) < 17:
        raise UsageError(f"glibc version {glibc!r}: expected 2.N with N >= 17")
    top = int(m.group(1))
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(top, 4, -1)]
    # The legacy aliases: manylinux2014 = 2.17, manylinux2010 = 2.12, manylinux1 = 2.5.
    tags += [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]
    return [arg for tag in tags for arg in ("--platform", tag)]


def unresolvable(log: str, reqs: list[str]) -> str:
    """The top-level requirement (its name) that the failed pip run could not resolve."""
    top = {requirement_name(r) for r in reqs} - {None}
    missing = None
    for line in log.splitlines():
        m = NOT_FOUND.match(line)
        if m:
            missing = canonical(m.group(1))
    if missing is None:
        raise UsageError("the pip log names no distribution it could not find")
    if missing in top:
        return missing
    for line in log.splitlines():
        m = PULLED_BY.match(line)
        if m and canonical(m.group(1)) == missing and canonical(m.group(2)) in top:
            return canonical(m.group(2))
    raise UsageError(f"{missing} is not a requirement and the log does not say which one pulled it in")


def drop(reqs: list[str], name: str) -> list[str]:
    kept = [r for r in reqs if requirement_name(r) != name]
    if len(kept) == len(reqs):
        raise UsageError(f"{name} is not in the requirements")
    return kept


def main(argv: list[str]) -> int:
    try:
        if len(argv) == 2 and argv[0] == "requirements":
            print("\n".join(requirements(_read(argv[1]))))
        elif len(argv) == 2 and argv[0] == "pyproject":
            entry_points = Path(argv[1]).with_name("entry_points.txt")
            print(pyproject(_read(argv[1]), _read(str(entry_points)) if entry_points.exists() else None), end="")
        elif len(argv) == 2 and argv[0] == "platform-args":
            print(" ".join(platform_args(argv[1])))
        elif len(argv) == 3 and argv[0] == "drop-unresolvable":
            path = Path(argv[2])
            reqs = [r for r in _read(argv[2]).splitlines() if r.strip()]
            name = unresolvable(_read(argv[1]), reqs)
            path.write_text("".join(r + "\n" for r in drop(reqs, name)))
            print(name)
        else:
            raise UsageError("usage: base_wheels.py requirements METADATA | pyproject METADATA | platform-args GLIBC"
                             " | drop-unresolvable PIP_LOG REQUIREMENTS")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
