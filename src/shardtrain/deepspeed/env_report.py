"""``ds_report``: what this environment runs, as ``shardtrain info`` prints it."""
import sys

__all__ = ["main"]


def main() -> int:
    from .. import cli
    return cli.main(["info", *sys.argv[1:]])
