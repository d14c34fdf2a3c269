"""``python -m shardtrain._launch_shim [--module] SCRIPT ARGS...``: what each worker of
``shardtrain run --local-rank-arg`` runs, by this name (the workers' command lines carry it).
An entry point only: the work is :func:`shardtrain.launch.run_with_local_rank`, which runs the
script with ``--local_rank=<LOCAL_RANK>`` in front of its arguments, as DeepSpeed's launcher
does.
"""
from __future__ import annotations

import sys

from .launch import run_with_local_rank as _run

if __name__ == "__main__":
    _run(sys.argv[1:])
