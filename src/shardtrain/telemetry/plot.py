"""PNG plots of a run: loss, learning rate, throughput and memory per rank.

Drawn with matplotlib's object API on the Agg backend (no display, no pyplot state), so that
plotting works on a headless node and inside a training process. matplotlib is an optional
extra, imported only when a plot is asked for.

Example:
    >>> plot_run("runs/demo")
    [PosixPath('runs/demo/plots/loss.png'), ...]
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional

from .metrics import read_metrics

__all__ = ["plot_run"]


def _require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'shardtrain[plot]' (or: pip install matplotlib)") \
            from None
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    return Figure


def plot_run(run_dir: str, out_dir: Optional[str] = None) -> List[Path]:
    """Writes PNG plots of a run's monitor files: loss, learning rate, throughput and memory
    per rank over steps (over samples when only CSV files exist).

    Args:
        run_dir: a monitor's ``output_path/job_name``.
        out_dir: where the PNGs go; default ``run_dir/plots``.

    Returns:
        The paths written (a plot with no data to show is skipped).

    Example:
        >>> plot_run("runs/demo")
        [PosixPath('runs/demo/plots/loss.png'), ...]
    """
    Figure = _require_matplotlib()
    records, x_name = read_metrics(run_dir)
    out = Path(out_dir) if out_dir else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, series, ylabel in _plot_series(records, x_name):
        if not series:
            continue
        fig = Figure(figsize=(7, 4), dpi=100)
        ax = fig.add_subplot()
        for label, xs, ys, style in series:
            ax.plot(xs, ys, style, label=label, linewidth=1.2)
        ax.set_xlabel(x_name)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{name} ({Path(run_dir).name})")
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path)
        written.append(path)
    return written


def _plot_series(records: List[Dict[str, Any]], x_name: str):
    def series(key: str, label: str, style: str = "-", scale: float = 1.0):
        pts = [(r[x_name], r[key] * scale) for r in records
               if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and x_name in r]
        return [(label, [p[0] for p in pts], [p[1] for p in pts], style)] if pts else []

    def per_rank(key: str, label: str, style: str):
        ranks = max((len(r.get(key) or []) for r in records), default=0)
        out = []
        for rank in range(ranks):
            pts = [(r[x_name], r[key][rank] / scale) for r in records
                   if len(r.get(key) or []) > rank and r[key][rank] is not None and x_name in r]
            if pts:
                out.append((f"{label} rank {rank}", [p[0] for p in pts], [p[1] for p in pts], style))
        return out

    largest = max((v for r in records for v in (r.get("memory_peak") or []) if v), default=0)
    unit, scale = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("bytes", 1))
                       if largest >= s or s == 1)
    yield "loss", series("loss", "loss"), "loss"
    yield "lr", series("lr", "learning rate"), "learning rate"
    throughput = series("tokens_per_s", "tokens/s") or series("samples_per_s", "samples/s")
    yield "throughput", throughput, throughput[0][0] if throughput else ""
    yield "memory", per_rank("memory_peak", "peak", "-") + per_rank("memory_allocated", "allocated", "--"), unit
