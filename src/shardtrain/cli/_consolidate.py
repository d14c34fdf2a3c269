"""``shardtrain consolidate``: one safetensors file of full weights from a checkpoint."""
from __future__ import annotations

import argparse
import sys

_EXAMPLES = """\
examples:
  shardtrain consolidate checkpoints/ model.safetensors
  shardtrain consolidate checkpoints/ model.safetensors --tag global_step500 --dtype bf16

The file loads with model.load_state_dict(safetensors.torch.load_file("model.safetensors")),
whatever the number of ranks and the ZeRO stage that saved the checkpoint.
"""


def add_parser(commands) -> None:
    sub = commands.add_parser(
        "consolidate", help="full weights of a checkpoint in one safetensors file",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Reads a checkpoint written by engine.save_checkpoint (any world size, any "
                    "ZeRO stage) in this one CPU process and writes the full model weights to "
                    "one safetensors file.", epilog=_EXAMPLES)
    sub.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                     help="the save_dir given to save_checkpoint (or one tag directory)")
    sub.add_argument("out", metavar="OUT.safetensors", help="the file to write")
    sub.add_argument("--tag", help="the checkpoint tag (default: the one named by 'latest')")
    sub.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                     help="cast floating-point weights (fp32 reads the fp32 masters)")
    sub.set_defaults(handler=_run, subparser=sub)


def _run(args: argparse.Namespace) -> int:
    from ..checkpoint import consolidate
    try:
        path = consolidate(args.checkpoint_dir, args.out, tag=args.tag, dtype=args.dtype)
    except (FileNotFoundError, ValueError) as err:
        print(f"{args.subparser.prog}: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0
