"""The ``shardtrain`` command: one parser, one private module per subcommand.

:func:`main` builds the parser and runs the handler the chosen subcommand registered. Each
module owns its command's options, examples and work, and registers itself with
``add_parser(commands)``:

* ``_run``: ``shardtrain run``, a torchrun command line (rendezvous and restarts are
  torchrun's) from its options or a DeepSpeed hostfile (:mod:`shardtrain.launch`, which the
  alias's ``deepspeed`` command reads too); the workers of ``--local-rank-arg`` start through
  ``python -m shardtrain._launch_shim``; ``_run_flags`` holds torchrun's and DeepSpeed's
  spellings of its options;
* ``_estimate``: ``shardtrain estimate``, model-state memory per rank for ZeRO stages 0-3;
* ``_model``: what ``--model`` names (a factory, a Hugging Face directory or config.json),
  built on the meta device: the one resolver of every command that takes a model;
* ``_info``: ``shardtrain info``, what a bug report needs;
* ``_doctor``: ``shardtrain doctor``, every rank's versions and devices, then compute and
  bandwidth across the ranks, naming a slow rank or pair;
* ``_trails``: ``shardtrain trails``, the collective trails ranks left behind, compared;
* ``_consolidate``: ``shardtrain consolidate``, a checkpoint's full weights in one file or
  in the Hugging Face layout;
* ``_import_deepspeed``: ``shardtrain import-deepspeed``, a DeepSpeed checkpoint converted;
* ``_autotune``: ``shardtrain autotune`` over :func:`shardtrain.autotune.autotune`;
* ``_plot``: ``shardtrain plot`` over :func:`shardtrain.telemetry.plot_run`;
* ``_alias``: ``shardtrain deepspeed-alias``; ``_distribution``: the ``deepspeed`` alias
  distribution it builds and installs, whose version (:func:`alias_version`) the alias tree
  :mod:`shardtrain.deepspeed` reads from here;
* ``_common``: the two kinds of error (a wrong argument exits with 2, failed work with 1),
  argument types that name a bad value, and number formatting.

``autotune`` and ``plot`` take their arguments unparsed and parse them in
:func:`autotune_main` and :func:`plot_main`, which Python code may call too, as it may their
parsers (:func:`build_autotune_parser`, :func:`build_plot_parser`) and registrations into
another command's subparsers (:func:`add_autotune_parser`, :func:`add_plot_parser`), which
the old modules :mod:`shardtrain.profiling` and :mod:`shardtrain.monitor` offer too. This package is
the only one that builds a parser for a shardtrain command, and the packages it launches
never import it; the alias tree (:mod:`shardtrain.deepspeed`) does, for its ``deepspeed`` and
``ds_report`` commands and its version, and this package never imports the alias tree.

Example:
    $ shardtrain run --nproc 2 train.py --config train.json
    $ shardtrain estimate --model mypkg.models:build --nproc 8 --dtype bf16
    $ shardtrain info
    $ shardtrain autotune train.py --config train.json --memory-budget 20GiB
    $ shardtrain plot runs/demo
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch

from .. import __version__
from . import (_alias, _autotune, _consolidate, _doctor, _estimate, _import_deepspeed,
               _info, _plot, _run, _trails)
from ._autotune import add_parser as add_autotune_parser
from ._autotune import autotune_main, build_autotune_parser
from ._common import _Failure, _UsageError
from ._distribution import DEEPSPEED_VERSION, alias_version
from ._plot import add_parser as add_plot_parser
from ._plot import build_plot_parser, plot_main

__all__ = ["main", "build_parser", "autotune_main", "plot_main", "build_autotune_parser",
           "build_plot_parser", "add_autotune_parser", "add_plot_parser", "DEEPSPEED_VERSION",
           "alias_version"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the ``shardtrain`` command; returns its exit status.

    Args:
        argv: the arguments after the program name; default ``sys.argv[1:]``.

    Example:
        >>> from shardtrain.cli import main
        >>> main(["estimate", "--model", "examples/models.py:gpt_small", "--nproc", "8"])
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except BrokenPipeError:  # `shardtrain info | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except _UsageError as err:
        args.subparser.error(str(err))  # prints the usage and the error, exits with 2
    except _Failure as err:
        print(f"{args.subparser.prog}: error: {err}", file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    """The ``shardtrain`` argument parser with every command."""
    parser = argparse.ArgumentParser(
        prog="shardtrain", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Distributed training for PyTorch: launch, size and diagnose.",
        epilog=_MAIN_EXAMPLES)
    parser.add_argument("--version", action="version",
                        version=f"shardtrain {__version__} (torch {torch.__version__})")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _run.add_parser(commands)
    _estimate.add_parser(commands)
    _info.add_parser(commands)
    _doctor.add_parser(commands)
    _trails.add_parser(commands)
    _consolidate.add_parser(commands)
    _import_deepspeed.add_parser(commands)
    _alias.add_parser(commands)
    _autotune.add_parser(commands)  # its arguments are parsed by autotune_main
    _plot.add_parser(commands)      # and these by plot_main
    return parser


_MAIN_EXAMPLES = """\
commands:
  run        start a training script on N processes and M machines (through torchrun)
  estimate   model-state memory per rank for ZeRO stages 0-3, from a model built on 'meta'
  info       torch, backends, devices and launcher environment, for bug reports
  consolidate  full weights of a checkpoint (any world size, any stage): one file, or a
               directory that from_pretrained loads
  import-deepspeed  convert a DeepSpeed checkpoint (ZeRO 0-3, universal) into a shardtrain one
  autotune   largest micro-batch that fits a memory budget per ZeRO stage, fastest config
  plot       PNG plots of loss, learning rate, throughput and memory from monitor files
  deepspeed-alias  install the deepspeed alias: libraries that import deepspeed run on shardtrain

examples:
  shardtrain run --nproc 2 train.py --config train.json
  shardtrain estimate --model mypkg.models:build --nproc 8 --dtype bf16
  shardtrain info
  shardtrain consolidate checkpoints/ model.safetensors
  shardtrain import-deepspeed ds_checkpoints/ checkpoints/
  shardtrain consolidate checkpoints/ hf-model/ --max-shard-size 5GB
  shardtrain autotune train.py --config train.json --memory-budget 20GiB --stages 0,2,3
  shardtrain plot runs/demo
  shardtrain deepspeed-alias install

'shardtrain COMMAND --help' explains each command.
"""
