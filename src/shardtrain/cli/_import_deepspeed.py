"""``shardtrain import-deepspeed``: a DeepSpeed checkpoint converted into a shardtrain one."""
from __future__ import annotations

import argparse
import sys

_EXAMPLES = """\
examples:
  shardtrain import-deepspeed ds_checkpoints/ checkpoints/
  shardtrain import-deepspeed ds_checkpoints/ checkpoints/ --tag global_step1000

Then engine.load_checkpoint("checkpoints") resumes it on any number of ranks and any ZeRO stage:
weights, fp32 masters, optimizer states, counters, scheduler and loss scaler.

DeepSpeed's files are pickles. They are read by torch's restricted unpickler, which refuses any
type outside a short list by name; --trust-pickle unpickles everything, which can run code
from the files: use it only for checkpoints whose origin you trust.
"""


def add_parser(commands) -> None:
    sub = commands.add_parser(
        "import-deepspeed", help="convert a DeepSpeed checkpoint into a shardtrain checkpoint",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Reads a checkpoint that DeepSpeed 0.19 saved (ZeRO stage 0-3, fp32/bf16/"
                    "fp16, any data-parallel world size, or its universal form; its MoE "
                    "layers' experts at stages 1-2) in this one CPU process, without "
                    "DeepSpeed, and writes it as a shardtrain checkpoint.",
        epilog=_EXAMPLES)
    sub.add_argument("ckpt_dir", metavar="CKPT_DIR",
                     help="the directory given to DeepSpeed's save_checkpoint (or a tag directory)")
    sub.add_argument("out_dir", metavar="OUT_DIR", help="where the shardtrain checkpoint goes")
    sub.add_argument("--tag", help="the DeepSpeed tag (default: the one named by 'latest')")
    sub.add_argument("--trust-pickle", action="store_true",
                     help="unpickle types outside the allow-list (runs code from the files)")
    sub.add_argument("--frozen", metavar="NAME[,NAME...]", default=None,
                     help="stage 0 only, when shapes cannot tell: the parameters the optimizer "
                          "did not hold")
    sub.set_defaults(handler=_run, subparser=sub)


def _run(args: argparse.Namespace) -> int:
    from ..checkpoint import import_deepspeed
    frozen = [n for n in args.frozen.split(",") if n] if args.frozen else None
    try:
        path = import_deepspeed(args.ckpt_dir, args.out_dir, tag=args.tag,
                                trust_pickle=args.trust_pickle, frozen=frozen)
    except (FileNotFoundError, ValueError, NotImplementedError) as err:
        print(f"{args.subparser.prog}: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0
