"""``shardtrain deepspeed-alias``: install, remove or build the ``deepspeed`` alias, so that
libraries which import deepspeed themselves (the Hugging Face Trainer, Accelerate, Lightning)
run on shardtrain. The work is done by :mod:`._distribution`."""
from __future__ import annotations

import argparse
from pathlib import Path

from . import _distribution as dist
from ._common import _Failure

_EXAMPLES = """\
examples:
  shardtrain deepspeed-alias install            # into this Python (offline, a few seconds)
  shardtrain deepspeed-alias install --replace  # where DeepSpeed itself is installed
  shardtrain deepspeed-alias status
  shardtrain deepspeed-alias uninstall
  shardtrain deepspeed-alias build dist/        # only write the wheel (for uv, pip --target, ...)

The alias is a distribution named deepspeed, version 0.19.8+shardtrain.<version>, whose
package is shardtrain.deepspeed. It is built on this machine: never upload it to a package
index (the name deepspeed belongs to DeepSpeed).
"""


def add_parser(commands) -> None:
    alias = commands.add_parser(
        "deepspeed-alias", help="install the deepspeed alias (libraries that import deepspeed "
                                "run on shardtrain)",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
        description="Installs into this Python a distribution named deepspeed that hands "
                    "`import deepspeed` over to shardtrain.deepspeed, so that the Hugging Face "
                    "Trainer, Accelerate, Lightning and DeepSpeed scripts run unchanged.",
        epilog=_EXAMPLES)
    actions = alias.add_subparsers(dest="action", metavar="ACTION", required=True)
    install = actions.add_parser("install", help="build the alias and pip-install it")
    install.add_argument("--replace", action="store_true",
                         help="replace DeepSpeed itself if it is installed")
    actions.add_parser("uninstall", help="remove the alias (never DeepSpeed itself)")
    actions.add_parser("status", help="which deepspeed `import deepspeed` gives")
    build = actions.add_parser("build", help="only write the alias wheel into DIR")
    build.add_argument("directory", type=Path, metavar="DIR")
    alias.set_defaults(handler=_cmd_alias, subparser=alias)


def _cmd_alias(args: argparse.Namespace) -> int:
    try:
        if args.action == "install":
            dist.install(replace=args.replace)
        elif args.action == "uninstall":
            dist.uninstall()
        elif args.action == "status":
            print(f"deepspeed: {dist.status_line()}")
        else:
            args.directory.mkdir(parents=True, exist_ok=True)
            print(dist.build_wheel(args.directory))
    except dist.AliasError as err:
        raise _Failure(str(err)) from None
    return 0
