"""``shardtrain autotune``: the largest micro-batch that fits a memory budget per ZeRO stage,
and the fastest configuration; the search itself is :func:`shardtrain.autotune.autotune`.

The command's options follow SCRIPT and the script's own arguments follow ``--``, so the
``shardtrain`` parser hands every argument over unparsed and :func:`autotune_main` splits and
parses them (``--help`` included).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

from ..memory import format_bytes
from ..autotune import AutotuneError, AutotuneResult, autotune, format_trials, parse_size


_AUTOTUNE_EXAMPLES = """\
examples:
  shardtrain autotune train.py --config train.json
  shardtrain autotune train.py --config train.json --memory-budget 20GiB --stages 0,2,3 --nproc 8
  shardtrain autotune train.py --config ds.json --config-arg --deepspeed_config -- --epochs 1

The script runs with --config <generated.json> (--config-arg names another option) and must
call engine.step(). A profile run measures activations and bytes per parameter; then, per stage,
short trials run around the largest micro-batch that fits the budget. Results go to
autotuning.results_dir (best_config.json, trials.csv); trial configs and logs to exps_dir.
"""


def build_autotune_parser(prog: str = "shardtrain autotune") -> argparse.ArgumentParser:
    """The argument parser of ``shardtrain autotune``."""
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        usage="%(prog)s SCRIPT --config CONFIG [options] [-- SCRIPT_ARGS...]",
        description="Finds the largest micro-batch that fits a memory budget for each ZeRO stage, "
                    "times short trials around it and writes the fastest configuration.",
        epilog=_AUTOTUNE_EXAMPLES)
    parser.add_argument("script", metavar="SCRIPT", help="the training script")
    parser.add_argument("--config", required=True, metavar="CONFIG", help="the script's JSON config")
    parser.add_argument("--memory-budget", type=_size_arg, metavar="SIZE",
                        help="memory per rank, e.g. 20GiB (default: the device's memory; on the CPU, "
                             "the available host memory shared by --nproc processes)")
    parser.add_argument("--stages", type=_stages_arg, default=[0, 1, 2, 3], metavar="LIST",
                        help="ZeRO stages to try, e.g. 0,2,3 (default: 0,1,2,3)")
    parser.add_argument("--metric", choices=("throughput", "latency", "flops"),
                        help="what to optimise (default: autotuning.metric, else throughput)")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="processes per trial, started through torchrun when above 1 (default: 1)")
    parser.add_argument("--results-dir", metavar="DIR", help="default: autotuning.results_dir")
    parser.add_argument("--exps-dir", metavar="DIR", help="default: autotuning.exps_dir")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="time limit per run (default: 600)")
    parser.add_argument("--config-arg", default="--config", metavar="OPTION",
                        help="the script's option for the config path (default: --config)")
    return parser


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _stages_arg(text: str) -> List[int]:
    try:
        stages = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        stages = []
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise argparse.ArgumentTypeError(f"expected ZeRO stages 0-3 separated by commas, got {text!r}")
    return sorted(set(stages))


def autotune_main(argv: Optional[Sequence[str]] = None) -> int:
    """``shardtrain autotune``: returns the exit status (0 when a configuration was found).

    Arguments after ``--`` go to the script.

    Example:
        >>> autotune_main(["train.py", "--config", "train.json", "--memory-budget", "8GiB"])
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    own, script_args = _split_script_args(argv)
    parser = build_autotune_parser()
    args = parser.parse_args(own)
    _check_args(parser, args)
    try:
        result = autotune(args.script, args.config, script_args, args.memory_budget, args.stages,
                          args.metric, args.nproc, args.results_dir, args.exps_dir, args.timeout,
                          args.config_arg, log=lambda line: print(line, flush=True))
    except AutotuneError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 1
    return _report(parser.prog, result)


def _split_script_args(argv: List[str]) -> Tuple[List[str], List[str]]:
    """(the command's own arguments, the script's: those after the first ``--``)."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not Path(args.script).is_file():
        parser.error(f"script not found: {args.script!r}")
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")


def _report(prog: str, result: AutotuneResult) -> int:
    """Prints the trials and the best configuration; 1 when no trial fitted the budget."""
    print(format_trials(result))
    print(f"trials: {result.table_path}")
    if result.best is None:
        print(f"{prog}: no trial fitted {format_bytes(result.budget)}; raise --memory-budget or try "
              f"more stages", file=sys.stderr)
        return 1
    print(f"best: stage {result.best.stage}, micro-batch {result.best.micro_batch} -> "
          f"{result.best_config_path}")
    return 0


def add_parser(commands: Any) -> None:
    """Registers ``shardtrain autotune`` on the ``shardtrain`` command's subcommands.

    Every argument is handed to :func:`autotune_main` as it is (``--help`` included), because
    the options follow SCRIPT and the script's own arguments follow ``--``.
    """
    sub = commands.add_parser("autotune", help="largest micro-batch that fits, fastest ZeRO stage",
                              add_help=False, prefix_chars="\0")  # no option is parsed here
    sub.add_argument("argv", nargs=argparse.REMAINDER)
    sub.set_defaults(handler=lambda args: autotune_main(args.argv), subparser=sub)
