"""scripts/install-into-python, the image's install step, against copies of the pristine package laid out
as site-packages and as an editable checkout, found through PYTHONPATH as the image finds its SGLang.
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

from tests.support.series_trees import REAL, git

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
    """Hard links: the scripts replace files by rename, so the pristine tree is never written through them."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def copy_pristine(dest: Path) -> Path:
    shutil.copytree(Path(PRISTINE) / "sglang", dest / "sglang", ignore=shutil.ignore_patterns("__pycache__", "*.so"),
                    copy_function=link_or_copy)
    return dest


def quick_python(path: Path, package: Path, fail_once_patched: str = "") -> Path:
    """An interpreter that answers the import check from the files under ``package`` (importing SGLang takes
    8 s; test_installed_folder runs it for real), or fails it with ``fail_once_patched`` once the tree is
    patched; everything else goes to the real interpreter."""
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
    """Given as --python env/bin/python, relative to the caller's folder (the interpreter runs from another),
    the real import check passes on the patched tree; a second run changes nothing; the tier is refused."""
    site = copy_pristine(tmp_path / "site")
    (tmp_path / "env").symlink_to(Path(sys.executable).parent.parent)  # a venv or an installation
    relative = f"env/bin/{Path(sys.executable).name}"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "install-into-python"), "--python", relative],
                          capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(site)))
    assert proc.returncode == 0, proc.stderr
    assert f"sglang imports from {site / 'sglang'}" in proc.stdout
    assert "series applied" in proc.stdout and "ok:" in proc.stdout
    assert (site / "sglang" / REAL.files[0]).read_bytes() != (Path(PRISTINE) / "sglang" / REAL.files[0]).read_bytes()
    quick = str(quick_python(tmp_path / "python", site / "sglang"))
    again = install(site, python=quick)  # a rebuilt layer or a second run
    assert again.returncode == 0 and "already applied" in again.stdout
    patched = listing(site)
    tier = install(site, "--run-cpu-tier", python=quick)  # the CPU tier needs the pristine tree
    assert tier.returncode != 0 and "already patched" in tier.stderr and listing(site) == patched


def test_an_environment_that_cannot_run_or_import_sglang_is_left_unpatched(tmp_path):
    """An interpreter that cannot run is one line. A bare venv (no numpy, no torch; the one running the tests may
    have an SGLang of its own): no sglang is a clear error; sglang/ not importable changes nothing, says why in full."""
    for python in ("/nonexistent/python3", "not-on-path-python"):
        proc = install(tmp_path, python=python)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr == f"error: cannot run {python}: No such file or directory; nothing changed\n"
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    proc = install(tmp_path / "empty", python=str(bare / "bin" / "python"))
    assert proc.returncode != 0 and "cannot import sglang" in proc.stderr
    site = copy_pristine(tmp_path / "site")
    before = listing(site)
    proc = install(site, python=str(bare / "bin" / "python"))
    assert proc.returncode == 1 and "nothing changed" in proc.stderr
    assert "Traceback (most recent call last):" in proc.stderr  # the whole traceback, not its tail
    assert re.search(r"\nModuleNotFoundError: No module named '\w+'$", proc.stderr.rstrip())
    assert listing(site) == before


@pytest.mark.parametrize("local_edit", [False, True])
def test_a_failure_after_patching_takes_the_series_out_again(tmp_path, local_edit):
    """The import check fails once the tree is patched; with --force over a local edit, the edit comes back."""
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


def test_an_editable_checkout_is_patched_at_its_root_and_the_tier_leaves_no_temporary_folders(tmp_path):
    """As in the image: an editable checkout, patched at its root, the tier run against it with a --basetemp
    removed afterwards (its /tmp folders were 500 MB of the image's layer). A stand-in plays pytest."""
    checkout = tmp_path / "sglang-checkout"
    copy_pristine(checkout / "python")
    git(checkout, "init", "-q")
    git(checkout, "add", "-A")
    git(checkout, "commit", "-qm", "v0.5.20")
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
