"""``shardtrain consolidate``: a checkpoint's full weights, in one file or in the Hugging Face
layout.

The output path decides which: a name ending in ``.safetensors`` (that is not an existing
directory) is one safetensors file for ``model.load_state_dict``, as it always was; any other
path is a directory in the layout ``from_pretrained`` reads (shards of at most
``--max-shard-size``, their index, config.json), streamed with bounded memory. A wrong
argument exits with 2, a checkpoint that cannot be read with 1.
"""
from __future__ import annotations

import argparse
import os
from typing import List

from ..memory import parse_size
from ._common import _Failure, _human, _plural, _UsageError

DEFAULT_SHARD_SIZE = "5GB"

_EXAMPLES = """\
examples:
  shardtrain consolidate checkpoints/ model.safetensors
  shardtrain consolidate checkpoints/ model.safetensors --tag global_step500 --dtype bf16
  shardtrain consolidate checkpoints/ hf-model/ --max-shard-size 2GB --dtype bf16

OUT.safetensors is one file: model.load_state_dict(safetensors.torch.load_file(OUT)).
Any other OUT is a directory in the Hugging Face layout: model.safetensors, or
model-0000k-of-0000n.safetensors shards with model.safetensors.index.json, and config.json
when the model had a Hugging Face config: AutoModelForCausalLM.from_pretrained(OUT).
Either works whatever the number of ranks and the ZeRO stage that saved the checkpoint.
"""


def add_parser(commands) -> None:
    sub = commands.add_parser(
        "consolidate", help="full weights of a checkpoint: one safetensors file, or the "
                            "Hugging Face layout",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Reads a checkpoint written by engine.save_checkpoint (any world size, any "
                    "ZeRO stage) in this one CPU process and writes the full model weights: to "
                    "one safetensors file when OUT ends in .safetensors, else to the directory "
                    "OUT in the layout of save_pretrained, shard by shard with bounded memory.",
        epilog=_EXAMPLES)
    sub.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                     help="the save_dir given to save_checkpoint (or one tag directory)")
    sub.add_argument("out", metavar="OUT",
                     help="OUT.safetensors: one file; any other path: a directory (created if "
                          "needed) in the Hugging Face layout")
    sub.add_argument("--tag", help="the checkpoint tag (default: the one named by 'latest')")
    sub.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                     help="cast floating-point weights (fp32 reads the fp32 masters)")
    sub.add_argument("--max-shard-size", metavar="SIZE", type=_size,
                     help="directory output only: the most tensor bytes per shard, e.g. 5GB, "
                          f"500MB, 2GiB (default {DEFAULT_SHARD_SIZE}, as Hugging Face counts)")
    sub.set_defaults(handler=_run, subparser=sub)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _run(args: argparse.Namespace) -> int:
    if _single_file(args.out):
        if args.max_shard_size is not None:
            raise _UsageError(f"--max-shard-size applies to a directory output; {args.out} "
                              "ends in .safetensors, which is one file. Give a directory to "
                              "write shards in the Hugging Face layout.")
        _consolidate(args)
    else:
        _export(args)
    return 0


def _single_file(out: str) -> bool:
    return out.endswith(".safetensors") and not os.path.isdir(out)


def _consolidate(args: argparse.Namespace) -> None:
    from ..checkpoint import consolidate
    try:
        path = consolidate(args.checkpoint_dir, args.out, tag=args.tag, dtype=args.dtype)
    except (OSError, ValueError) as err:
        raise _Failure(str(err)) from None
    print(f"wrote {path}")


def _export(args: argparse.Namespace) -> None:
    from ..checkpoint import export_pretrained
    size = args.max_shard_size or parse_size(DEFAULT_SHARD_SIZE)
    try:
        paths = export_pretrained(args.checkpoint_dir, args.out, max_shard_size=size,
                                  tag=args.tag, dtype=args.dtype)
    except (OSError, ValueError) as err:
        raise _Failure(str(err)) from None
    print(_summary(args.out, paths))


def _summary(out: str, paths: List[str]) -> str:
    shards = [p for p in paths if p.endswith(".safetensors")]
    others = [os.path.basename(p) for p in paths if p not in shards]
    size = sum(os.path.getsize(p) for p in shards)
    extra = f", {' and '.join(others)}" if others else ""
    return f"wrote {out}: {_plural(len(shards), 'shard')} ({_human(size)}){extra}"
