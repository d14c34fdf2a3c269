"""``engine.load_checkpoint`` on a DeepSpeed checkpoint, as DeepSpeed's own load takes it.

DeepSpeed's load reads the tag that ``latest`` names, or with ``checkpoint.load_universal`` its
universal form (``ds_to_universal``'s output, named by ``latest_universal``) on any world size.
shardtrain's own checkpoints already load on any world size; so ``load_checkpoint`` takes
both:

* a shardtrain checkpoint (its tag directory holds ``meta.json``) loads as always, so a job
  resumed from DeepSpeed keeps the key and resumes from its own checkpoints later;
* a DeepSpeed checkpoint (universal, or as ``save_checkpoint`` wrote it) is converted by
  :func:`shardtrain.checkpoint.import_deepspeed` into a temporary directory by one process
  per node, in a subprocess (the conversion runs without a process group), loaded from there
  by every rank, and removed. The copy takes about 14 bytes per parameter (weights, fp32
  masters, Adam's moments) in ``$TMPDIR``; a job that resumes the same DeepSpeed checkpoint
  often converts it once with ``shardtrain import-deepspeed`` instead.

Every rank raises the same error when the conversion fails on any node, before the engine
changes.
"""
from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from .. import comm
from ..log import logger
from . import _engine_state as engine_state
from ._agreement import Problem, agree, capture
from ._deepspeed_files import is_tag_dir, latest_tag
from ._format import LATEST
from ._loading import load_checkpoint

__all__ = ["load_universal"]

_UNIVERSAL_LATEST = "latest_universal"
# The subprocess: load_dir, out_dir, tag, then the module's untrained parameters.
_CONVERT = ("import sys\n"
            "from shardtrain.checkpoint import import_deepspeed\n"
            "a = sys.argv[1:]\n"
            "try:\n"
            "    import_deepspeed(a[0], a[1], tag=a[2], untrained=a[3:])\n"
            "except (FileNotFoundError, ValueError, NotImplementedError) as err:\n"
            "    sys.exit(f'{type(err).__name__}: {err}')\n")


def load_universal(engine: Any, load_dir: str, tag: Optional[str], *options: bool,
                   prefer_universal: bool = True
                   ) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """``load_checkpoint(engine, load_dir, tag, *options)`` that also takes a DeepSpeed
    checkpoint (see the module's text); without ``tag``, DeepSpeed's is the one
    ``latest_universal`` names when ``prefer_universal`` (the config's
    ``checkpoint.load_universal``), else ``latest``'s."""
    load_dir = os.fspath(load_dir)
    latest_files = (_UNIVERSAL_LATEST, LATEST) if prefer_universal else (LATEST,)
    source_tag = _deepspeed_tag(load_dir, tag, latest_files)
    if source_tag is None:  # a shardtrain checkpoint, or nothing there: the usual load
        return load_checkpoint(engine, load_dir, tag, *options)
    token = comm.broadcast_object(secrets.token_hex(6) if comm.get_rank() == 0 else None)
    work = os.path.join(tempfile.gettempdir(), f"shardtrain-universal-{token}-{socket.gethostname()}")
    box = [None]
    with capture(box):
        if comm.get_local_rank() == 0:
            if comm.get_rank() == 0:
                logger.info("load_checkpoint: converting the DeepSpeed checkpoint %s into %s (one "
                            "process per node); to resume it often, convert it once with "
                            "`shardtrain import-deepspeed`", os.path.join(load_dir, source_tag), work)
            untrained = [n for n, p in engine_state.named_params(engine.training_parts())
                         if not p.requires_grad]
            _convert(load_dir, source_tag, work, untrained)
    try:
        agree(box[0])
        _, client_state = load_checkpoint(engine, work, source_tag, *options)
        comm.barrier()  # every rank of this node has read the copy
    finally:
        if comm.get_local_rank() == 0:
            shutil.rmtree(work, ignore_errors=True)
    return os.path.join(load_dir, source_tag), client_state


def _deepspeed_tag(load_dir: str, tag: Optional[str], latest_files: Tuple[str, ...]
                   ) -> Optional[str]:
    """The tag of the DeepSpeed checkpoint at ``load_dir`` (``tag``, else the one the first of
    ``latest_files`` there names); None when that tag is no DeepSpeed checkpoint (a
    shardtrain one, or nothing: the usual load takes it and says what is missing)."""
    if tag is None and os.path.isdir(load_dir):
        try:
            tag = latest_tag(load_dir, latest_files)
        except (Problem, ValueError):  # a damaged `latest`: the usual load names it on every rank
            return None
    if tag is None or not is_tag_dir(os.path.join(load_dir, str(tag))):
        return None
    return str(tag)


def _convert(load_dir: str, tag: str, work: str, untrained: List[str]) -> None:
    """:func:`import_deepspeed` in a subprocess (no process group there); the module's
    frozen parameters settle a stage-0 checkpoint that shapes cannot."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    shutil.rmtree(work, ignore_errors=True)
    done = subprocess.run([sys.executable, "-c", _CONVERT, load_dir, work, tag, *untrained],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise Problem(ValueError, f"load_checkpoint: converting the DeepSpeed checkpoint "
                                  f"{os.path.join(load_dir, tag)} failed: "
                                  f"{lines[-1] if lines else f'exit status {done.returncode}'}")
