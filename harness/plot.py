"""Draw harness/transfer_bench.py's JSON: throughput against batch size, a line per variant.

    python -m harness.plot build/bench/transfer.json build/bench/transfer.png

One panel per (pool, direction, host layout); the pinned-copy bandwidth of the same run
is the dashed line every panel is bounded by, and 95% of it the dotted grey line (the
target for large batches). Solid lines: throughput by CUDA-event time
(host included); dotted, same colour: by the GPU time of the copies alone, where the
run recorded it. A run of several rounds is drawn by its medians. Needs matplotlib
(requirements/bench.txt). Input it cannot draw is refused in one `error:` line, exit 2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.transfer_bench import merge_rounds

LINK_TARGET = 0.95   # large transfers should reach this share of the pinned copy

VARIANTS = {
    "native": ("SGLang 0.5.20, dense pool", "black"),
    "patched-dense": ("patched, dense pool", "tab:blue"),
    "kvcached-contiguous": ("patched, kvcached contiguous", "tab:orange"),
    "kvcached-per-layer": ("patched, kvcached per-layer", "tab:green"),
}


def panels(rows):
    return sorted({(r["pool"], r["direction"], r["host_layout"]) for r in rows if r["pool"] != "link"})


# what matplotlib's savefig writes (canvas.get_supported_filetypes()), known before importing it
FORMATS = ("png", "svg", "pdf", "jpg", "jpeg", "webp", "tif", "tiff", "eps", "ps", "svgz", "pgf", "raw", "rgba")


def fail(why: str):
    print(f"error: {why}", file=sys.stderr)
    sys.exit(2)


def main(src, dst):
    try:
        data = json.loads(Path(src).read_text())
        rows = [r for r in merge_rounds(data["rows"]) if "GBps" in r]
        keys = panels(rows)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:   # missing, not JSON, not ours
        fail(f"{src}: not a transfer_bench.py --out file it can read ({type(exc).__name__}: {exc})")
    if not keys:
        fail(f"{src}: no measured rows to draw")
    if Path(dst).is_dir() or Path(dst).suffix.lower()[1:] not in FORMATS:  # a folder: matplotlib writes DST.png
        fail(f"{dst}: name an image file ({', '.join(FORMATS)})")
    if not Path(dst).parent.is_dir():
        fail(f"{dst}: no folder {Path(dst).parent}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("harness/plot.py needs matplotlib (pip install -r requirements/bench.txt)")
    draw(rows, data.get("meta", {}), dst)


def draw(rows: list[dict], meta: dict, dst) -> None:
    """The figure of measured rows (merged, with GBps) into the image file `dst`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    link = {r["direction"]: r["GBps"] for r in rows if r["pool"] == "link"}
    keys = panels(rows)
    cols = 4
    grid_rows = (len(keys) + cols - 1) // cols
    height = 3.3 * grid_rows + 0.7   # the legend's two lines below the panels
    fig, axes = plt.subplots(grid_rows, cols, figsize=(4.2 * cols, height), squeeze=False)
    for ax, (pool, direction, layout) in zip(axes.flat, keys):
        for mode, (label, color) in VARIANTS.items():
            points = sorted((r["batch"], r["GBps"]) for r in rows
                            if (r["mode"], r["pool"], r["direction"], r["host_layout"]) == (mode, pool, direction, layout))
            if points:
                ax.plot(*zip(*points), marker="o", ms=3, label=label, color=color)
            gpu_points = sorted((r["batch"], r["batch_bytes"] / r["kernel_us"] / 1e3) for r in rows
                                if "kernel_us" in r and "batch_bytes" in r and (r["mode"], r["pool"], r["direction"], r["host_layout"])
                                == (mode, pool, direction, layout))
            if gpu_points:
                ax.plot(*zip(*gpu_points), ls=":", lw=1.2, color=color, label=f"{label}, GPU time only")
        if direction in link:
            ax.axhline(link[direction], ls="--", color="grey", lw=1, label="pinned copy")
            ax.axhline(LINK_TARGET * link[direction], ls=":", color="grey", lw=1,
                       label=f"{LINK_TARGET:.0%} of the pinned copy")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, max(link.values(), default=60) * 1.08)
        ax.set_title(f"{pool} {direction}, host {layout}", fontsize=9)
        ax.set_xlabel("slots" if pool == "Mamba" else "tokens", fontsize=8)
        ax.set_ylabel("GB/s", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    fig.suptitle(f"HiCache transfers, {meta.get('gpu', '?')}, torch {meta.get('torch', '?')}, "
                 f"{meta.get('date', '')}, median of {meta.get('reps', '?')}"
                 + (f", then of {meta['rounds']} rounds" if meta.get("rounds", 1) > 1 else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.7 / height, 1, 1 - 0.3 / height))
    fig.savefig(dst, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
