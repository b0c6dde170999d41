"""The CPU tier (`make test`) in two parts that together run every test once, the first
where the image's build runs it:

    python -m tests.support.cpu_tier [--image-part] [PYTEST_ARGS...]

1. the tests the image's build runs (`-m "not project_files and not l3_store"`, the
   selection of scripts/install-into-python --run-cpu-tier), in a copy of the image's
   project folder: the Dockerfile's COPY lines filled from the build context that
   .dockerignore leaves (tests/support/build_context.py), in a temporary folder outside
   any git checkout, as /opt/elastic-hicache is in the image;
2. the rest (`project_files`, `l3_store`: checks of this project's own files, the
   Mooncake tests), in the checkout.

So a test that reads a file the image lacks (README.md, docs/, the Makefile, git
history) without being marked `project_files` fails in `make test`, as it would in
`make image`, whichever process reads it (the test's own, or a script, git or make
that it starts): the file is not there. `--image-part` runs part 1 only; test files or
ids among PYTEST_ARGS (tests/cpu/test_x.py::test_y) narrow either part to them.

The SGLang trees are the caller's: PYTHONPATH (less this checkout) and PRISTINE_SGLANG,
as `make test` sets them. The wheel scripts/fetch-wheel keeps in build/cache is shared
with the checkout, so that it is downloaded once.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.build_context import context_files, instructions

ROOT = Path(__file__).resolve().parents[2]
# What scripts/install-into-python runs inside the image (its --basetemp aside);
# tests/cpu/test_install_into_python.py checks that the two agree.
SELECTION = "not project_files and not l3_store"
IMAGE_TIER = ["-m", SELECTION, "tests/cpu"]
REST = ["-m", f"not ({SELECTION})", "tests/cpu"]
UPSTREAM = ["tests/upstream"]  # the tests the series' upstream PRs carry, in SGLang's style
CACHE = Path("build") / "cache"
NOTHING_RAN = 5  # pytest's exit status when no test is selected


class LayoutError(Exception):
    """A Dockerfile this copy cannot lay out as the image would."""


def lay_out(into: Path, root: Path = ROOT) -> list[str]:
    """Fill ``into`` as the Dockerfile's COPY lines fill the image's WORKDIR from the
    build context of ``root``; returns the files copied (relative paths). Each COPY
    must copy a context path to the same path under WORKDIR."""
    files = sorted(context_files(root))
    copied = []
    for keyword, args in instructions((root / "Dockerfile").read_text()):
        words = shlex.split(args) if keyword in ("COPY", "ADD") else []
        same_place = len(words) == 2 and not words[0].startswith("--") and (
            words[1] == words[0] or (words[1] == "./" and "/" not in words[0].rstrip("/")))
        if keyword == "ADD" or (words and not same_place):
            raise LayoutError(f"{keyword} {args}: not laid out by this copy (only COPY PATH PATH, or a top-level "
                              "PATH to ./)")
        if not words:
            continue
        src = words[0].rstrip("/")
        for rel in files:
            if rel == src or rel.startswith(src + "/"):
                dest = into / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / rel, dest, follow_symlinks=False)
                copied.append(rel)
    return copied


def tier_env(work: Path, root: Path = ROOT) -> dict[str, str]:
    """The caller's environment with ``root`` (and this checkout) off PYTHONPATH and ``work`` first on it
    (as scripts/install-into-python puts the image's project folder first); relative
    paths made absolute, since the tier runs in ``work``."""
    env = dict(os.environ)
    checkouts = {root.resolve(), ROOT}
    others = [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep)
              if p and Path(p).resolve() not in checkouts]
    env["PYTHONPATH"] = os.pathsep.join([str(work), *others])
    if env.get("PRISTINE_SGLANG"):
        env["PRISTINE_SGLANG"] = str(Path(env["PRISTINE_SGLANG"]).resolve())
    return env


def _share(src: Path, dst: Path) -> None:
    """Hard-link (or copy) into ``dst`` the files of ``src`` that it lacks."""
    if not src.is_dir():
        return
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not (dst / path.name).exists():
            try:
                os.link(path, dst / path.name)
            except OSError:
                shutil.copy2(path, dst / path.name)


def pytest(args: list[str], part: list[str], cwd: Path, env: dict[str, str] | None = None) -> int:
    """pytest over ``part`` (its -m selection and folders), or, where ``args`` name test files
    or ids (tests/cpu/test_x.py::test_y), over those of them in the part's folders."""
    folders = [a for a in part[2:] if not a.startswith("-")] if part[:1] == ["-m"] else part
    options = part[:len(part) - len(folders)]
    folders = [f for f in folders if (cwd / f).is_dir()]
    if not folders:
        return NOTHING_RAN
    named = [a for a in args if not a.startswith("-") and (cwd / a.split("::")[0]).exists()]
    mine = [a for a in named if any((a + "/").startswith(f.rstrip("/") + "/") for f in folders)]
    if named and not mine:
        return NOTHING_RAN
    others = [a for a in args if a not in named]
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *others, *options,
                           *(mine or folders)], cwd=cwd, env=env).returncode


def run_image_part(pytest_args: list[str], root: Path = ROOT) -> int:
    """Part 1: lay out the image's folder in a temporary one, run the image's tests there
    with ``pytest_args`` added, remove the folder; pytest's exit status."""
    work = Path(tempfile.mkdtemp(prefix="image-tier-")).resolve()
    try:
        if work.is_relative_to(root.resolve()):
            raise LayoutError(f"the temporary folder {work} is inside {root}: set TMPDIR to a folder outside it")
        work.chmod(0o755)  # as the image's WORKDIR: other users' tests read it (mkdtemp: 0700)
        lay_out(work, root)
        _share(root / CACHE, work / CACHE)
        print(f"== the image's tests ({SELECTION}) in a copy of what the Dockerfile copies ({work})", flush=True)
        status = pytest(pytest_args, IMAGE_TIER, work, tier_env(work, root))
        _share(work / CACHE, root / CACHE)
        return status
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str], root: Path = ROOT) -> int:
    if argv[:1] == ["--image-part"]:
        return run_image_part(argv[1:], root)
    parts = {"the image's tests": run_image_part(argv, root)}
    print("== the rest (project_files, l3_store) in the checkout", flush=True)
    parts["the rest"] = pytest(argv, REST, root)
    print("== tests/upstream in the checkout", flush=True)
    parts["tests/upstream"] = pytest(argv, UPSTREAM, root)
    if all(status == NOTHING_RAN for status in parts.values()):
        return NOTHING_RAN
    failed = [name for name, status in parts.items() if status not in (0, NOTHING_RAN)]  # tests given: in one part
    if failed:
        print(f"the CPU tier failed: {', '.join(failed)}", file=sys.stderr)
    return next((parts[name] for name in failed), 0)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except LayoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
