"""``shardtrain plot RUN_DIR``: PNG plots of a run's monitor files, drawn by
:func:`shardtrain.telemetry.plot_run`."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional, Sequence

from ..telemetry import plot_run


_PLOT_EXAMPLES = """\
examples:
  shardtrain plot runs/demo                # writes runs/demo/plots/{loss,lr,throughput,memory}.png
  shardtrain plot runs/demo --out figures

RUN_DIR is a monitor's output_path/job_name: it holds metrics.jsonl (jsonl_monitor) or the CSV
files of csv_monitor. Needs matplotlib (pip install 'shardtrain[plot]').
"""


def build_plot_parser(prog: str = "shardtrain plot") -> argparse.ArgumentParser:
    """The argument parser of ``shardtrain plot``."""
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Plots loss, learning rate, throughput and memory per rank over steps from "
                    "the monitor files of a run, as PNG files.",
        epilog=_PLOT_EXAMPLES)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a monitor's output_path/job_name")
    parser.add_argument("--out", metavar="DIR", help="where the PNGs go (default: RUN_DIR/plots)")
    return parser


def plot_main(argv: Optional[Sequence[str]] = None) -> int:
    """``shardtrain plot RUN_DIR``: returns the exit status.

    Example:
        >>> plot_main(["runs/demo"])
        0
    """
    parser = build_plot_parser()
    args = parser.parse_args(argv)
    try:
        written = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    if not written:
        print(f"{parser.prog}: error: {args.run_dir} has no values to plot yet", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


def add_parser(commands: Any) -> None:
    """Registers ``shardtrain plot`` on the ``shardtrain`` command's subcommands; every
    argument is handed to :func:`plot_main` as it is (``--help`` included)."""
    sub = commands.add_parser("plot", help="PNG plots of a run's monitor files",
                              add_help=False, prefix_chars="\0")  # no option is parsed here
    sub.add_argument("argv", nargs=argparse.REMAINDER)
    sub.set_defaults(handler=lambda args: plot_main(args.argv), subparser=sub)
