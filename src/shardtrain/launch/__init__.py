"""Launching as DeepSpeed's launcher does, shared by the two commands that launch:
``shardtrain run`` (:mod:`shardtrain.cli`) and the alias's ``deepspeed``
(:mod:`shardtrain.deepspeed.launcher.runner`), which translates its options into the former.

* :mod:`._hostfile`: DeepSpeed's hostfile (``HOST slots=N`` lines): :func:`read_hostfile`,
  :class:`Host`, :class:`HostfileError`, and :func:`local_names`, the names this host
  answers to in one;
* :mod:`._shim`: :func:`run_with_local_rank`, what a worker of ``shardtrain run
  --local-rank-arg`` runs (as ``python -m shardtrain._launch_shim``): the script with
  ``--local_rank=<n>`` first among its arguments, as DeepSpeed's launcher passes it.

The processes themselves are torchrun's; this package builds no command line and imports no
other room, so that both commands can import it without importing each other.

Example:
    >>> from shardtrain.launch import read_hostfile
    >>> [(h.name, h.slots) for h in read_hostfile(Path("hostfile"))]
    [('worker-0', 8), ('worker-1', 8)]
"""
from ._hostfile import Host, HostfileError, local_names, read_hostfile
from ._shim import run_with_local_rank

__all__ = ["Host", "HostfileError", "read_hostfile", "local_names", "run_with_local_rank"]
