"""Process groups and collectives.

This is the only package that imports ``torch.distributed``. Everything else asks it for
ranks and calls its named collectives, so that the rules (how a process finds its rank,
what a world of one process does, how a collective is counted, what a failed one reports)
live in one place:

* :mod:`._trail`: the collective trail, a ring of records in a memory-mapped file, and the
  first difference between ranks' trails (:func:`read_trail`, :func:`first_difference`);
* :mod:`._roll_call`: what the survivors of a failed collective find out through the
  rendezvous store (:func:`process_gone`);
* :mod:`._process`: the default process group, joined and left (:func:`init_distributed`,
  :func:`destroy`), this process's place in it, the default timeout;
* :mod:`._groups`: :class:`Group` (the world, a :class:`Mesh`'s dimensions, split groups,
  the side group) and :func:`set_timeout`, which bounds their collectives;
* :mod:`._bounds`: :class:`CollectiveBounds`, the short bound inside training steps and the
  long one outside, as the engine enters and leaves them;
* :mod:`._sigterm`: SIGTERM waits while a collective runs, so that a survivor says what it
  was doing before torchrun's stop ends it;
* :mod:`._tracing`: this rank's trail, where training is (:func:`set_position`,
  :func:`labelled`, :func:`mark`);
* :mod:`._timing`: :class:`CollectiveTiming` and :func:`time_collectives`;
* :mod:`._report`: every collective's guarded call, and :class:`CollectiveError`'s report
  when one fails;
* :mod:`._divergence`: the divergence check (:func:`set_check`, :func:`check_agreement`,
  :class:`DivergenceError`);
* :mod:`._ops`: the collectives;
* :mod:`._traced`: :class:`InGraph`, the collectives ``torch.compile`` traces into its
  graphs (torch's functional collectives, for DeepCompile).

Imports go one way, in that order: each module imports only those above it.

Example:
    >>> import shardtrain
    >>> shardtrain.init_distributed()     # reads torchrun / SLURM / OpenMPI variables
    >>> shardtrain.comm.get_world_size()
    1
"""
from __future__ import annotations

from ._bounds import CollectiveBounds
from ._divergence import CHECK_MODES, DivergenceError, check_agreement, check_mode, set_check
from ._groups import (MESH_DIMS, PIPELINE_DIMS, WORLD, Group, Mesh, SideGroup, init_mesh,
                      set_timeout, side_group, split_groups)
from ._ops import (ReduceOp, Work, add_observer, all_gather, all_gather_object, all_reduce,
                   all_to_all_single, barrier, broadcast, broadcast_coalesced, broadcast_object,
                   irecv, recv, remove_observer, reduce_scatter, scatter, send)
from ._process import (FLIGHT_RECORDER_ENV, LaunchEnv, available_backends, before_destroy,
                       default_timeout, destroy, detect_launch_env, flight_recorder_prefix,
                       get_backend, get_local_rank, get_local_world_size, get_rank,
                       get_world_size, init_distributed, is_initialized, timeout_override)
from ._report import CollectiveError
from ._roll_call import process_gone
from ._timing import CollectiveTiming, time_collectives
from ._traced import InGraph
from ._tracing import keep_trail, labelled, mark, set_position, trail, trail_dir
from ._trail import Entry as TrailEntry
from ._trail import first_difference
from ._trail import read as read_trail

__all__ = [
    "init_distributed", "destroy", "is_initialized", "get_rank", "get_world_size",
    "get_local_rank", "get_local_world_size", "get_backend", "available_backends", "barrier",
    "ReduceOp", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "broadcast_coalesced",
    "scatter", "all_to_all_single", "send", "recv", "irecv",
    "all_gather_object", "broadcast_object", "Work", "add_observer", "remove_observer",
    "split_groups", "CollectiveError", "DivergenceError", "set_position", "labelled", "mark",
    "set_check", "check_agreement", "set_timeout", "timeout_override", "default_timeout",
    "trail", "trail_dir", "keep_trail", "CHECK_MODES", "check_mode", "flight_recorder_prefix",
    "FLIGHT_RECORDER_ENV",
    "LaunchEnv", "detect_launch_env", "Group", "WORLD", "SideGroup", "side_group",
    "before_destroy", "MESH_DIMS", "PIPELINE_DIMS", "Mesh", "init_mesh", "CollectiveTiming", "time_collectives",
    "CollectiveBounds", "TrailEntry", "read_trail", "first_difference", "process_gone", "InGraph",
]
