"""This checkout as the tools record it: the pins, the series' state, the trees a run uses,
and the --out check every tool makes before any work.

  pinned()          sglang.pin's KEY=value lines (the file the Makefile includes);
  official_image()  SGLang's official image by digest; project_image(): `make image`'s tag;
  series_module()   scripts/_series.py, the series scripts' own reading of patches/;
  patches_state()   the series digest scripts/apply records in a tree, and each file's sha256;
  tree_state()      scripts/status's first line for a folder holding sglang/;
  check_trees()     a run's pristine and patched trees are what their names say, or nothing runs;
  make_out()        --out's folder made before any work, or why it cannot be.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pinned(path: Path = ROOT / "sglang.pin") -> dict[str, str]:
    """sglang.pin's KEY=value lines (the file the Makefile includes)."""
    pin = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and not key.startswith("#"):
            pin[key] = value
    return pin


def official_image(pin: dict[str, str] | None = None) -> str:
    """SGLang's official image by digest, as `make e2e` and the Dockerfile take it."""
    pin = pin or pinned()
    return f"{pin['SGLANG_IMAGE']}@{pin['SGLANG_IMAGE_DIGEST']}"


def project_image(pin: dict[str, str] | None = None) -> str:
    """The tag `make image` gives this project's image."""
    return f"sglang-elastic-hicache:{(pin or pinned())['SGLANG_VERSION']}"


def series_module():
    """scripts/_series.py, loaded from its file (scripts/ is a folder of commands, not a
    package): the digest and the patch list are the series scripts' own, never re-derived."""
    module = sys.modules.get("_series")
    if module is None:
        spec = importlib.util.spec_from_file_location("_series", ROOT / "scripts" / "_series.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["_series"] = module   # its dataclasses look their module up by name
        spec.loader.exec_module(module)
    return module


def patches_state(patches: Path = ROOT / "patches") -> dict:
    """The series digest (scripts/_series.py's, which scripts/apply records in the tree) and
    the sha256 of patches/series and of each patch it lists."""
    series_lib = series_module()
    series = series_lib.Series(patches)
    return {"digest": series.digest,
            "files": {name: series_lib.sha((patches / name).read_bytes()) for name in ["series", *series.patches]}}


def tree_state(path: str) -> str:
    """scripts/status's first line for a folder holding sglang/ (series pristine/applied/...)."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "status"), path], capture_output=True, text=True)
    return (proc.stdout.splitlines() or [proc.stderr.strip()])[0]


def check_trees(pristine: str | None, patched: str | None) -> dict[str, str]:
    """The local launcher's trees must be what their names say; else nothing runs."""
    states = {}
    for name, path, want in (("pristine", pristine, "series pristine"), ("patched", patched, "series applied")):
        if not path or not (Path(path) / "sglang").is_dir():
            raise SystemExit(f"--launcher local needs --{name}-path: a folder holding an sglang/ package "
                             f"(harness/trees.sh makes one); got {path!r}")
        states[name] = tree_state(path)
        if not states[name].endswith(want):
            raise SystemExit(f"--{name}-path {path}: scripts/status says '{states[name]}', expected '{want}'")
    return states


def make_out(path: str | Path, folder: bool = False) -> str:
    """--out before any work: the folder it goes in made (with `folder`: itself), so that a
    run does not fail at its end; why it cannot be written, else ''."""
    path = Path(path)
    if path.is_dir() and not folder:
        return f"--out {path} is a folder: name a file"
    try:
        (path if folder else path.parent).mkdir(parents=True, exist_ok=True)
    except OSError as exc:      # a file where a folder must be, or no permission
        return f"--out {path}: cannot make the folder {exc.filename} ({exc.strerror})"
    return ""
