"""The CPU tier (`make test`): every test once, the image's own where and as the image's build runs them.

    python -m tests.support.cpu_tier [--image-part] [PYTEST_ARGS...]

1. the image's tests (`-m "not project_files and not l3_store"`, the selection of
   scripts/install-into-python --run-cpu-tier) in a copy of the image's project folder: the
   Dockerfile's COPY lines filled from the build context .dockerignore leaves
   (tests/support/build_context.py), in a temporary folder outside any git checkout, as
   /opt/elastic-hicache is; against a copy of PRISTINE_SGLANG installed as the image's base
   installs it (editable by pip: it imports through setuptools' import finder, not
   PYTHONPATH) and patched there by scripts/install-into-python, run from the copy;
2. meanwhile the rest (`project_files`, `l3_store`: checks of this project's own files, the
   Mooncake tests), in the checkout, against the caller's PYTHONPATH; much of it waits on
   stand-in servers. Its output is held back and shown after part 1's;
3. then tests/upstream, in the checkout.

So a test that reads a file the image lacks (README.md, docs/, the Makefile, git history)
without being marked `project_files`, or that relies on PYTHONPATH choosing the SGLang it
imports, fails in `make test` as it would in `make image`. `--image-part` runs part 1 only;
test files or ids among PYTEST_ARGS (tests/cpu/test_x.py::test_y) narrow each part to them.
All run with OMP_NUM_THREADS=1 unless it is set (main says why; the image's build, one part
alone, leaves it unset). The wheel scripts/fetch-wheel keeps in build/cache is shared with
the checkout, so that it is downloaded once.
"""
from __future__ import annotations

import os
import runpy
import shutil
import signal
import site
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What scripts/install-into-python runs inside the image (its --basetemp aside);
# tests/cpu/test_install_into_python.py checks that the two agree.
SELECTION = "not project_files and not l3_store"
IMAGE_TIER = ["-m", SELECTION, "tests/cpu"]
REST = ["-m", f"not ({SELECTION})", "tests/cpu"]
UPSTREAM = ["tests/upstream"]  # the tests the series' upstream PRs carry, in SGLang's style
CACHE = Path("build") / "cache"
NOTHING_RAN = 5  # pytest's exit status when no test is selected
# Part 1 is busy on the CPU, part 2 mostly waits: part 1 runs on two pytest-xdist workers, a
# file's tests on one (a module's fixture is built once).
WORKERS = ["-n", "2", "--dist", "loadfile"]


class LayoutError(Exception):
    """A Dockerfile this copy cannot lay out as the image would."""


def lay_out(into: Path, root: Path = ROOT) -> list[str]:
    """Fill ``into`` as the Dockerfile's COPY lines fill the image's WORKDIR from the
    build context of ``root``; returns the files copied (relative paths). Each COPY
    must copy a context path to the same path under WORKDIR."""
    # Here, not at the top: the image's tier imports this module (IMAGE_TIER) without docker's packages.
    from tests.support.build_context import context_files, copies

    files = sorted(context_files(root))
    copied = []
    for copy in copies((root / "Dockerfile").read_text(), context_only=False):
        words = copy.value
        same_place = len(words) == 2 and not copy.flags and (
            words[1] == words[0] or (words[1] == "./" and "/" not in words[0].rstrip("/")))
        if copy.cmd == "ADD" or not same_place:
            raise LayoutError(f"{copy.original}: not laid out by this copy (only COPY PATH PATH, or a top-level "
                              "PATH to ./)")
        src = words[0].rstrip("/")
        for rel in files:
            if rel == src or rel.startswith(src + "/"):
                dest = into / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / rel, dest, follow_symlinks=False)
                copied.append(rel)
    return copied


def image_python(into: Path, pristine: Path) -> Path:
    """A Python whose SGLang is a copy of ``pristine`` (a folder holding sglang/) at the image's
    /sgl-workspace/sglang/python, installed editable with the pyproject.toml the stand-in base
    writes (ci/image/base_wheels.py). Its other packages are this interpreter's (a .pth)."""
    project = into / "sgl-workspace" / "sglang" / "python"
    shutil.copytree(pristine / "sglang", project / "sglang", ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = runpy.run_path(str(ROOT / "ci" / "image" / "base_wheels.py"))["pyproject"]
    version = dict(line.split("=", 1) for line in (ROOT / "sglang.pin").read_text().splitlines()
                   if "=" in line and not line.startswith("#"))["SGLANG_VERSION"]
    (project / "pyproject.toml").write_text(pyproject(f"Name: sglang\nVersion: {version}\n"))
    env = into / "python"
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], capture_output=True, text=True)
    if made.returncode != 0:
        raise LayoutError(f"{sys.executable} -m venv {env} failed: {made.stderr.strip()}")
    python = env / "bin" / "python"
    site_packages = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        capture_output=True, text=True, check=True).stdout.strip())
    (site_packages / "_caller_site.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in site.getsitepackages()) + "\n")
    pip = subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                          "-e", str(project)], capture_output=True, text=True)
    if pip.returncode != 0:
        raise LayoutError(f"pip could not install {project} editable (pip and setuptools come from this "
                          f"interpreter):\n{pip.stdout}{pip.stderr}")
    if not list(site_packages.glob("__editable___*_finder.py")):
        raise LayoutError(f"setuptools installed {project} without its import finder: not as the image's base")
    return python


def image_env() -> dict[str, str]:
    """The caller's environment as the Dockerfile's install step has it: no PYTHONPATH, kvcached off."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return dict(env, ENABLE_KVCACHED="false")


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


def pytest_command(args: list[str], part: list[str], cwd: Path,
                   python: Path | str = sys.executable) -> list[str] | None:
    """pytest over ``part`` (its -m selection and folders), or, where ``args`` name test files
    or ids (tests/cpu/test_x.py::test_y), over those of them in the part's folders; None
    where the part has none of them."""
    folders = [a for a in part[2:] if not a.startswith("-")] if part[:1] == ["-m"] else part
    options = part[:len(part) - len(folders)]
    folders = [f for f in folders if (cwd / f).is_dir()]
    if not folders:
        return None
    named = [a for a in args if not a.startswith("-") and (cwd / a.split("::")[0]).exists()]
    mine = [a for a in named if any((a + "/").startswith(f.rstrip("/") + "/") for f in folders)]
    if named and not mine:
        return None
    others = [a for a in args if a not in named]
    return [str(python), "-m", "pytest", "-p", "no:cacheprovider", *others, *options, *(mine or folders)]


def pytest(args: list[str], part: list[str], cwd: Path, env: dict[str, str] | None = None,
           python: Path | str = sys.executable) -> int:
    """pytest_command's run: its exit status (NOTHING_RAN where there is nothing to run)."""
    command = pytest_command(args, part, cwd, python)
    return NOTHING_RAN if command is None else subprocess.run(command, cwd=cwd, env=env).returncode


def pristine_tree() -> Path:
    pristine = os.environ.get("PRISTINE_SGLANG")
    if not pristine:
        raise LayoutError("PRISTINE_SGLANG is not set: the image's part installs a copy of that pristine tree "
                          "(make test sets it)")
    return Path(pristine).resolve()


def run_image_part(pytest_args: list[str], root: Path = ROOT) -> int:
    """Part 1, in a temporary folder removed after: pytest's exit status (or the install step's)."""
    pristine = pristine_tree()
    base = Path(tempfile.mkdtemp(prefix="image-tier-")).resolve()
    try:
        if base.is_relative_to(root.resolve()):
            raise LayoutError(f"the temporary folder {base} is inside {root}: set TMPDIR to a folder outside it")
        base.chmod(0o755)  # as the image's folders: other users' tests read them (mkdtemp: 0700)
        work = base / "opt"
        work.mkdir(mode=0o755)
        lay_out(work, root)
        _share(root / CACHE, work / CACHE)
        print(f"== the image's tests ({SELECTION}) in a copy of what the Dockerfile copies ({work}), against "
              "SGLang installed editable (setuptools' import finder) and patched by scripts/install-into-python",
              flush=True)
        python = image_python(base, pristine)
        env = image_env()
        step = subprocess.run([str(python), "scripts/install-into-python", "--python", str(python)], cwd=work, env=env)
        if step.returncode != 0:
            print("the image's install step failed (above)", file=sys.stderr)
            return step.returncode
        status = pytest([*WORKERS, *pytest_args], IMAGE_TIER, work,
                        dict(env, PYTHONPATH=str(work), PRISTINE_SGLANG=str(pristine)), python)
        _share(work / CACHE, root / CACHE)
        return status
    finally:
        shutil.rmtree(base, ignore_errors=True)


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C to a process's group (pytest tears its fixtures down), then SIGKILL."""
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:  # the group is gone
            break
        except subprocess.TimeoutExpired:
            pass
    proc.wait()


def main(argv: list[str], root: Path = ROOT) -> int:
    # One torch thread a process, unless the caller says otherwise: with two parts (and
    # their subprocesses) on two cores, torch's OpenMP threads spin waiting for a core,
    # and make test took 5 min 23 s instead of 4 min 5 s.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if argv[:1] == ["--image-part"]:
        return run_image_part(argv[1:], root)
    pristine_tree()
    rest = pytest_command(argv, REST, root)
    with tempfile.TemporaryFile() as held:  # the rest's output, shown after the image's part
        # A session of its own, so that it can be stopped whole (its servers too) if part 1 stops.
        started = rest and subprocess.Popen(rest, cwd=root, stdin=subprocess.DEVNULL, stdout=held,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            parts = {"the image's tests": run_image_part(argv, root)}
        except BaseException:
            if started:
                stop(started)
            raise
        print("== the rest (project_files, l3_store) in the checkout, run beside the image's tests", flush=True)
        parts["the rest"] = started.wait() if started else NOTHING_RAN
        held.seek(0)
        shutil.copyfileobj(held, sys.stdout.buffer)
        sys.stdout.flush()
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
