"""The other spellings ``shardtrain run`` takes: torchrun's and DeepSpeed's launcher's.

A command line copied from torchrun's or DeepSpeed's documentation should run, or say which
option to use instead: never argparse's bare "unrecognized arguments". Every spelling of one
of our options is its own hidden argparse option with the same destination, so an error names
the flag as it was typed (``--num_gpus``, not ``--nproc``); :func:`spelled` gives that name
back to the checks made after parsing. Options with no counterpart here are hidden options too,
which stop the parse with what to do instead.

Only the options before SCRIPT are read: everything after it belongs to the script, whatever
it looks like (``_run`` keeps it in an ``argparse.REMAINDER``).
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, Tuple

#: our option -> torchrun's and DeepSpeed's launcher's names for it
ALIASES: Dict[str, Tuple[str, ...]] = {
    "--nproc": ("--nproc-per-node", "--nproc_per_node", "--num_gpus", "--num_accelerators"),
    "--nnodes": ("--num_nodes",),
    "--node-rank": ("--node_rank",),
    "--rdzv-endpoint": ("--rdzv_endpoint",),
    "--rdzv-id": ("--rdzv_id",),
    "--rdzv-backend": ("--rdzv_backend",),
    "--max-restarts": ("--max_restarts",),
    "--hostfile": ("-H",),
}

# What each launcher's option with no counterpart here should become.
_TORCHRUN_ITSELF = ("start torchrun itself (`torchrun [its options] SCRIPT`): "
                    "shardtrain.initialize() reads the environment it sets")
_OUTPUT = ("every rank's output comes to this terminal: keep it with "
           "`shardtrain run ... 2>&1 | tee run.log`, or start torchrun itself for per-rank files")
_ONE_MACHINE = ("shardtrain run starts the processes of the machine it runs on: run it on every "
                "node (by hand, pdsh or srun) with --node-rank, or let srun/mpirun start "
                "`python SCRIPT` itself (shardtrain.initialize() reads their variables)")
_SELECT = ("shardtrain run takes whole hosts: list only those to use in --hostfile, and choose "
           "GPUs with CUDA_VISIBLE_DEVICES (the `deepspeed` command of `shardtrain "
           "deepspeed-alias install` takes --include/--exclude)")

#: option spellings -> (whose, what to do instead)
REFUSED: Dict[Tuple[str, ...], Tuple[str, str]] = {
    ("--rdzv-conf", "--rdzv_conf"): ("torchrun", _TORCHRUN_ITSELF),
    ("--monitor-interval", "--monitor_interval"): ("torchrun", _TORCHRUN_ITSELF),
    ("--start-method", "--start_method"): ("torchrun", _TORCHRUN_ITSELF),
    ("--event-log-handler", "--event_log_handler"): ("torchrun", _TORCHRUN_ITSELF),
    ("--role",): ("torchrun", _TORCHRUN_ITSELF),
    ("--local-addr", "--local_addr"): ("torchrun", _TORCHRUN_ITSELF),
    ("--logs-specs", "--logs_specs"): ("torchrun", _TORCHRUN_ITSELF),
    ("--numa-binding", "--numa_binding"): ("torchrun", _TORCHRUN_ITSELF),
    ("--signals-to-handle", "--signals_to_handle"): ("torchrun", _TORCHRUN_ITSELF),
    ("--shutdown-timeout", "--shutdown_timeout"): ("torchrun", _TORCHRUN_ITSELF),
    ("--virtual-local-rank", "--virtual_local_rank"): ("torchrun", _TORCHRUN_ITSELF),
    ("--duplicate-stdout-filters", "--duplicate_stdout_filters"): ("torchrun", _TORCHRUN_ITSELF),
    ("--duplicate-stderr-filters", "--duplicate_stderr_filters"): ("torchrun", _TORCHRUN_ITSELF),
    ("--log-dir", "--log_dir"): ("torchrun", _OUTPUT),
    ("-r", "--redirects"): ("torchrun", _OUTPUT),
    ("-t", "--tee"): ("torchrun", _OUTPUT),
    ("--local-ranks-filter", "--local_ranks_filter"): ("torchrun", _OUTPUT),
    ("--no-python", "--no_python"): ("torchrun's and DeepSpeed", "SCRIPT must be a Python file, "
                                     "or a module name with -m"),
    ("-i", "--include"): ("DeepSpeed", _SELECT),
    ("-e", "--exclude"): ("DeepSpeed", _SELECT),
    ("--launcher",): ("DeepSpeed", _ONE_MACHINE),
    ("--launcher_args",): ("DeepSpeed", _ONE_MACHINE),
    ("--force_multi",): ("DeepSpeed", _ONE_MACHINE),
    ("--ssh_port",): ("DeepSpeed", _ONE_MACHINE),
    ("--venv_script",): ("DeepSpeed", "activate the environment on each node before "
                                      "shardtrain run"),
    ("--autotuning",): ("DeepSpeed", "`shardtrain autotune SCRIPT --config ds.json`"),
    ("--save_pid",): ("DeepSpeed", "shardtrain run becomes torchrun's process (exec): its pid "
                                   "is the one you started"),
    ("--enable_each_rank_log",): ("DeepSpeed", _OUTPUT),
    ("--bind_cores_to_rank",): ("DeepSpeed", "set OMP_NUM_THREADS and bind with numactl or "
                                             "taskset around the command"),
    ("--bind_core_list",): ("DeepSpeed", "set OMP_NUM_THREADS and bind with numactl or taskset "
                                         "around the command"),
    ("--log_level",): ("DeepSpeed", "drop it: shardtrain run prints nothing but torchrun's and "
                                    "the script's output"),
    ("-q", "--quiet"): ("DeepSpeed", "drop it: shardtrain run prints nothing but torchrun's and "
                                     "the script's output"),
}

#: options whose meaning is already what shardtrain run does -> why they change nothing
ALREADY: Dict[Tuple[str, ...], str] = {
    ("--run-path", "--run_path"): "torchrun's: SCRIPT runs from its path",
    ("--no_ssh",): "DeepSpeed's: every node runs the command itself",
    ("--no_ssh_check",): "DeepSpeed's: nothing is reached over ssh",
}


class _Spelled(argparse.Action):
    """``store``, remembering the spelling it was given as (for :func:`spelled`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        # A new dict each time: the parser's default one is shared by every parse.
        namespace.spelled = {**getattr(namespace, "spelled", {}), self.dest: option_string}


class _Already(argparse.Action):
    """A flag that asks for what ``shardtrain run`` does anyway: accepted, nothing to store."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        pass


class _Refused(argparse.Action):
    """Stops the parse: this launcher option has no counterpart in ``shardtrain run``."""

    def __init__(self, option_strings, dest, whose: str, instead: str, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)
        self.whose, self.instead = whose, instead

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is {self.whose}'s option, which shardtrain run does not "
                     f"take; instead, {self.instead}")


def add_option(parser: argparse.ArgumentParser, flag: str, **kwargs: Any) -> None:
    """Adds ``flag`` as --help shows it, and each of its other spellings in :data:`ALIASES` as
    a hidden option with the same destination and checks (one option per spelling, so that
    argparse's own errors name the one typed)."""
    dest = parser.add_argument(flag, action=_Spelled, **kwargs).dest
    hidden = {k: v for k, v in kwargs.items() if k not in ("default", "help")}
    for alias in ALIASES.get(flag, ()):
        parser.add_argument(alias, dest=dest, action=_Spelled, default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS, **hidden)


def add_foreign_options(parser: argparse.ArgumentParser) -> None:
    """The launchers' options with no spelling of ours: ``--standalone``, ``--master_addr``
    and ``--master_port``, ``--no_local_rank``, the ones that change nothing, the refused."""
    parser.set_defaults(spelled={})
    parser.add_argument("--standalone", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--master-addr", "--master_addr"):
        parser.add_argument(flag, dest="master_addr", action=_Spelled, type=_host,
                            default=None if flag == "--master-addr" else argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    for flag in ("--master-port", "--master_port"):
        parser.add_argument(flag, dest="master_port", action=_Spelled, type=_port,
                            default=None if flag == "--master-port" else argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    parser.add_argument("--no_local_rank", dest="local_rank_arg", action="store_false",
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    for flags in ALREADY:
        parser.add_argument(*flags, action=_Already)
    for flags, (whose, instead) in REFUSED.items():
        parser.add_argument(*flags, action=_Refused, whose=whose, instead=instead)


def spelled(args: argparse.Namespace, dest: str, default: str) -> str:
    """The option as the user typed it (``--num_gpus``), or ``default`` (``--nproc``)."""
    return args.spelled.get(dest, default)


def _host(text: str) -> str:
    if not text or any(c.isspace() for c in text) or text.startswith("-"):
        raise argparse.ArgumentTypeError(f"expected a host name or address, got {text!r}")
    return text


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"expected a port in 1-65535, got {text!r}")
    return port
