"""Runs a training script with ``--local_rank=<LOCAL_RANK>`` in front of its arguments.

DeepSpeed's launcher passes that argument to every worker and scripts written for it parse
it (some require it); torchrun passes ``LOCAL_RANK`` in the environment only.
``shardtrain run --local-rank-arg`` starts each worker as
``python -m shardtrain._launch_shim [--module] SCRIPT ARGS...``, which calls
:func:`run_with_local_rank`: it rewrites ``sys.argv`` the way DeepSpeed's launcher builds it
and runs the script as ``__main__``.
"""
from __future__ import annotations

import os
import runpy
import sys
from typing import List

__all__ = ["run_with_local_rank"]


def run_with_local_rank(argv: List[str]) -> None:
    """Runs ``[--module] SCRIPT ARGS...`` as ``__main__`` with ``--local_rank=$LOCAL_RANK``
    first among its arguments."""
    module = bool(argv) and argv[0] == "--module"
    if module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m shardtrain._launch_shim [--module] SCRIPT [ARGS...]")
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None:
        raise SystemExit("shardtrain._launch_shim: LOCAL_RANK is not set; start it through "
                         "`shardtrain run --local-rank-arg` (torchrun sets LOCAL_RANK).")
    target, rest = argv[0], argv[1:]
    # DeepSpeed's launcher puts --local_rank right after the script, before its arguments.
    sys.argv = [target, f"--local_rank={local_rank}", *rest]
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    # `python script.py` puts the script's folder first on sys.path (not the cwd, as -m does).
    sys.path[0] = os.path.dirname(os.path.abspath(target))
    runpy.run_path(target, run_name="__main__")
