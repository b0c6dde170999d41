"""scripts/install-into-python: the image's install step, run against local SGLang folders.

The Dockerfile runs this script against the SGLang the image's Python imports; here it
runs against copies of the pristine 0.5.20 package laid out as an installed
site-packages folder and as an editable checkout (python/sglang), found through
PYTHONPATH the way the image's interpreter finds /sgl-workspace/sglang.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.series_trees import REAL

ROOT = Path(__file__).resolve().parents[2]
PRISTINE = os.environ.get("PRISTINE_SGLANG")
pytestmark = pytest.mark.skipif(not PRISTINE, reason="set by `make test`: the pristine tree's python/ folder")


def install(search_path: Path, *args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(search_path))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "install-into-python"),
                           "--python", python, *args], capture_output=True, text=True, env=env)


def listing(tree: Path) -> dict[str, str]:
    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tree.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def link_or_copy(src, dst):
    """Hard links: the scripts replace files by rename, never in place, so the pristine
    tree the links share inodes with is never written (and copying 5,000 files is slow)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def copy_pristine(dest: Path) -> Path:
    shutil.copytree(Path(PRISTINE) / "sglang", dest / "sglang", ignore=shutil.ignore_patterns("__pycache__", "*.so"),
                    copy_function=link_or_copy)
    return dest


def quick_python(path: Path, package: Path, fail_once_patched: str = "") -> Path:
    """A stand-in interpreter at ``path`` that answers install-into-python's import check
    from the files under ``package`` instead of importing SGLang (8 s a time), for runs
    where that check is not what is tested (test_installed_folder runs it for real, as does
    `make test`'s image part); or, given ``fail_once_patched``, fails it with that message
    once the tree is patched. Everything else goes to the real interpreter."""
    path.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import filecmp, os, re, sys
        if sys.argv[1:2] == ["-c"] and "import_module" in sys.argv[2]:
            pristine = {str(Path(PRISTINE).resolve() / "sglang" / REAL.files[0])!r}
            if {fail_once_patched!r} and not filecmp.cmp({str(package / REAL.files[0])!r}, pristine, False):
                sys.exit({fail_once_patched!r})
            modules = re.findall(r"'sglang[.]([a-z0-9_.]+)'", sys.argv[2])
            print(*[os.path.join({str(package)!r}, *m.split(".")) + ".py" for m in modules])
            sys.exit(0)
        os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])
        """))
    path.chmod(0o755)
    return path


def test_installed_folder(tmp_path):
    """Given as --python env/bin/python, relative to the caller's folder (the script runs the
    interpreter from another folder), the real import check passes on the patched tree; a
    second run finds the series applied and changes nothing."""
    site = copy_pristine(tmp_path / "site")
    (tmp_path / "env").symlink_to(Path(sys.executable).parent.parent)  # a venv or an installation
    relative = f"env/bin/{Path(sys.executable).name}"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "install-into-python"), "--python", relative],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(site)))
    assert proc.returncode == 0, proc.stderr
    assert f"sglang imports from {site / 'sglang'}" in proc.stdout
    assert "series applied" in proc.stdout and "ok:" in proc.stdout
    assert (site / "sglang" / REAL.files[0]).read_bytes() != (Path(PRISTINE) / "sglang" / REAL.files[0]).read_bytes()
    # Idempotent: a rebuilt layer or a second run changes nothing.
    again = install(site, python=str(quick_python(tmp_path / "python", site / "sglang")))
    assert again.returncode == 0 and "already applied" in again.stdout


def test_no_sglang_is_a_clear_error(tmp_path):
    # A bare venv: the interpreter running the tests may have an SGLang of its own (the image's).
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    proc = install(tmp_path / "empty", python=str(bare / "bin" / "python"))
    assert proc.returncode != 0 and "cannot import sglang" in proc.stderr


def test_cpu_tier_needs_the_pristine_tree(tmp_path):
    site = copy_pristine(tmp_path / "site")
    assert subprocess.run([sys.executable, str(ROOT / "scripts" / "apply"), str(site)]).returncode == 0
    proc = install(site, "--run-cpu-tier")
    assert proc.returncode != 0 and "already patched" in proc.stderr


def test_an_environment_that_cannot_import_sglang_is_left_unpatched(tmp_path):
    """A Python that finds sglang/ but cannot import it (a bare venv: no numpy, no torch)
    changes nothing, and says why in full."""
    site = copy_pristine(tmp_path / "site")
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    before = listing(site)
    proc = install(site, python=str(bare / "bin" / "python"))
    assert proc.returncode == 1 and "nothing changed" in proc.stderr
    assert "Traceback (most recent call last):" in proc.stderr  # the whole traceback, not its tail
    assert re.search(r"\nModuleNotFoundError: No module named '\w+'$", proc.stderr.rstrip())
    assert listing(site) == before


@pytest.mark.parametrize("local_edit", [False, True])
def test_a_failure_after_patching_takes_the_series_out_again(tmp_path, local_edit):
    """Here the interpreter stops importing SGLang once the tree is patched; with --force over a
    local edit, taking the series out brings the edit back."""
    site = copy_pristine(tmp_path / "site")
    if local_edit:  # a new file, not a write through the hard link into the pristine tree
        edited = site / "sglang" / REAL.files[1]
        text = edited.read_text()
        edited.unlink()
        edited.write_text("# a local edit\n" + text)
    reason = "SimulatedError: " + " ".join(f"word{i}" for i in range(120))  # far longer than any cut
    python = quick_python(tmp_path / "python", site / "sglang", fail_once_patched=reason)
    before = listing(site)
    proc = install(site, *(["--force"] if local_edit else []), python=str(python))
    assert proc.returncode == 1 and reason in proc.stderr
    assert "the series was taken out again; the tree is as it was" in proc.stderr
    assert listing(site) == before


@pytest.mark.parametrize("python", ["/nonexistent/python3", "not-on-path-python"])
def test_an_interpreter_that_cannot_run_is_one_line(tmp_path, python):
    proc = install(tmp_path, python=python)
    assert proc.returncode == 1 and proc.stderr == f"error: cannot run {python}: No such file or directory; nothing changed\n"


def test_an_editable_checkout_is_patched_at_its_root_and_the_tier_leaves_no_temporary_folders(tmp_path):
    """As in the image: SGLang an editable checkout, patched at its root, and the tier run
    against it. Found by the image's build: the tier's pytest left its temporary folders in
    /tmp, over 500 MB in the image's layer. The tier must get a --basetemp that is removed
    afterwards. Here a stand-in interpreter plays pytest (writes into --basetemp, records
    its arguments) and passes everything else to the real one."""
    checkout = tmp_path / "sglang-checkout"
    copy_pristine(checkout / "python")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
    subprocess.run(["git", "add", "-A"], cwd=checkout, check=True)
    subprocess.run([*git, "commit", "-qm", "v0.5.20"], cwd=checkout, check=True)
    temp, log = tmp_path / "temp", tmp_path / "pytest-args"
    temp.mkdir()
    quick = quick_python(tmp_path / "quick-python", checkout / "python" / "sglang")
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        if [ "$1 $2" = "-m pytest" ]; then
          printf '%s\\n' "$@" > {log}
          while [ $# -gt 0 ]; do [ "$1" = --basetemp ] && mkdir -p "$2/test0" && echo x > "$2/test0/f"; shift; done
          exit 0
        fi
        exec {quick} "$@"
        """))
    fake.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(checkout / "python"), TMPDIR=str(temp))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "install-into-python"), "--python", str(fake),
                           "--run-cpu-tier"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"applying the series to {checkout}" in proc.stdout
    assert "(checkout layout): series applied" in proc.stdout
    args = log.read_text().splitlines()
    assert "--basetemp" in args and Path(args[args.index("--basetemp") + 1]).is_relative_to(temp)
    # The tests it runs are the ones `make test` runs in a copy of the image's folder.
    from tests.support.cpu_tier import IMAGE_TIER
    assert args[-len(IMAGE_TIER):] == IMAGE_TIER
    # The pristine copy and pytest's folders are gone (what SGLang's imports leave in
    # TMPDIR, e.g. a per-user folder, is theirs).
    assert [p.name for p in temp.iterdir() if p.name.startswith(("sglang-pristine-", "sglang-tier-"))] == []
