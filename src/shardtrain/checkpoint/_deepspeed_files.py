"""DeepSpeed's checkpoint files: finding them, and reading them without running their code.

A DeepSpeed checkpoint is ``<save_dir>/<tag>/`` with ``<save_dir>/latest`` naming the tag
(``latest_universal`` for the universal form). Its files are ``torch.save`` pickles. They are
read with torch's restricted unpickler (``torch.load(weights_only=True)``), which builds
containers, numbers, strings and tensors and nothing else, plus the few DeepSpeed types its
checkpoints hold, each received by an inert stand-in defined here, so neither DeepSpeed nor
any code from the file runs:

========================================================  ===========================
DeepSpeed's name                                          stand-in
========================================================  ===========================
``deepspeed.runtime.fp16.loss_scaler.LossScaler``         :class:`LossScalerState`
``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``  :class:`LossScalerState`
``deepspeed.runtime.zero.config.ZeroStageEnum``           :class:`ZeroStage`
``deepspeed.utils.tensor_fragment.fragment_address``      :class:`FragmentAddress`
========================================================  ===========================

A file that names any other type is refused with the type's name before anything in it is
unpickled. ``trust_pickle=True`` is the one way past that: the file is then unpickled in full
(the stand-ins still receive DeepSpeed's types), which runs whatever code it names: only for
checkpoints whose origin is trusted. Files are memory-mapped where torch can, so a tensor is
read from the disk only when it is used.
"""
from __future__ import annotations

import enum
import os
import pickle
import re
import types
import zipfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ._paths import check_tag, inside, regular_file

__all__ = ["LossScalerState", "ZeroStage", "FragmentAddress", "STAND_INS", "DeepSpeedFiles",
           "locate", "load_pickle", "is_tag_dir", "latest_tag"]


class LossScalerState:
    """Receives the attributes of DeepSpeed's (static or dynamic) loss scaler; no methods."""


class ZeroStage(enum.IntEnum):
    """Receives DeepSpeed's ZeRO stage enum (its values are the stage numbers)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class FragmentAddress:
    """Receives DeepSpeed's ``fragment_address`` (``numel``, ``start``) of a parameter's slice
    in a rank's partition."""

    numel: int
    start: int

STAND_INS: Dict[str, Any] = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerState,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScalerState,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
}

MODEL_STATES = "mp_rank_00_model_states.pt"
_ZERO_FILE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt")
_STAGE_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
_LAYER_FILE = re.compile(r"layer_(\d+)-model_states\.pt")
_EXPERT_FILE = re.compile(r"layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt")
_NOT_DEEPSPEED = ("pass the directory given to DeepSpeed's save_checkpoint (it holds 'latest') "
                  "or one of its tag directories")


@dataclass
class DeepSpeedFiles:
    """The files of one DeepSpeed checkpoint tag."""

    tag_dir: str
    tag: str
    universal: bool
    model_states: List[str]          # rank order (one file below stage 3)
    optim_states: List[str] = field(default_factory=list)  # rank order
    # a mixture of experts' weights, one file per expert: by (MoE layer, global expert index)
    experts: Dict[Tuple[int, int], str] = field(default_factory=dict)
    # a pipeline's: each layer's weights by global layer index, and each stage's optimizer
    # files (data-parallel rank order); model_states then holds each stage's file
    layers: Dict[int, str] = field(default_factory=dict)
    stage_optim_states: List[List[str]] = field(default_factory=list)


def locate(ckpt_dir: str, tag: Optional[str]) -> DeepSpeedFiles:
    """The files of the checkpoint ``tag`` of ``ckpt_dir`` (default: the tag ``latest`` or
    ``latest_universal`` names); ``ckpt_dir`` may also be a tag directory itself."""
    ckpt_dir = os.fspath(ckpt_dir)
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"DeepSpeed checkpoint directory {ckpt_dir!r} does not exist; "
                                "check the path.")
    if tag is None and is_tag_dir(ckpt_dir):
        return _files(os.path.normpath(ckpt_dir), os.path.basename(os.path.normpath(ckpt_dir)))
    tag = tag if tag is not None else _latest(ckpt_dir)
    check_tag(str(tag), f"DeepSpeed checkpoint {ckpt_dir}")
    tag_dir = os.path.join(ckpt_dir, str(tag))
    if not os.path.isdir(tag_dir) or not inside(tag_dir, ckpt_dir):
        tags = sorted(e for e in os.listdir(ckpt_dir) if is_tag_dir(os.path.join(ckpt_dir, e)))
        raise FileNotFoundError(f"DeepSpeed checkpoint tag {str(tag)!r} not found in "
                                f"{ckpt_dir!r} (tags there: {tags or 'none'}); pass one of "
                                "them with --tag.")
    if not is_tag_dir(tag_dir):
        raise ValueError(f"{tag_dir} is not a DeepSpeed checkpoint: it holds no "
                         f"{MODEL_STATES} nor zero_pp_rank_*_mp_rank_00_model_states.pt; "
                         f"{_NOT_DEEPSPEED}.")
    return _files(tag_dir, str(tag))


def is_tag_dir(path: str) -> bool:
    """Whether ``path`` holds a DeepSpeed checkpoint's model states files (or a pipeline's
    layer files)."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return MODEL_STATES in names or any(
        m is not None and m.group(4) == "model" for m in map(_ZERO_FILE.fullmatch, names)) \
        or any(map(_LAYER_FILE.fullmatch, names))


def latest_tag(ckpt_dir: str, names: Sequence[str] = ("latest", "latest_universal")
               ) -> Optional[str]:
    """The tag held by the first of ``names`` found in ``ckpt_dir`` (None if none is there);
    a symbolic link is refused."""
    for name in names:
        path = os.path.join(ckpt_dir, name)
        if os.path.islink(path):
            raise ValueError(f"{path} is a symbolic link; it must be a file holding a tag "
                             "name: replace it, or pass --tag.")
        if regular_file(path, ckpt_dir) is not None:
            with open(path, "rb") as f:
                return f.read(4096).decode("utf-8", errors="replace").strip()
    return None


def _latest(ckpt_dir: str) -> str:
    tag = latest_tag(ckpt_dir)
    if tag is not None:
        return tag
    raise ValueError(f"{ckpt_dir} is not a DeepSpeed checkpoint: it has no 'latest' or "
                     f"'latest_universal' file and no model states files; {_NOT_DEEPSPEED}, "
                     "or name the tag with --tag.")


def _files(tag_dir: str, tag: str) -> DeepSpeedFiles:
    names = sorted(os.listdir(tag_dir))
    layers = {int(m.group(1)): os.path.join(tag_dir, name)
              for name in names for m in [_LAYER_FILE.fullmatch(name)] if m}
    for name in names:
        what = _unsupported(name, pipeline=bool(layers))
        if what is not None:
            raise NotImplementedError(
                f"{os.path.join(tag_dir, name)}: {what} DeepSpeed checkpoints are not "
                "supported; only data-parallel ZeRO checkpoints (stages 0-3), their "
                "universal form and pipelines at ZeRO stage 1 convert.")
    if layers:
        return _pipeline_files(tag_dir, tag, names, layers)
    universal = os.path.isdir(os.path.join(tag_dir, "zero"))
    zero = _zero_files(tag_dir, names).get(0, {})
    model = [os.path.join(tag_dir, MODEL_STATES)] if MODEL_STATES in names \
        else _rank_order(zero.get("model", {}), tag_dir, "model")
    optim = [] if universal else _rank_order(zero.get("optim", {}), tag_dir, "optim")
    experts = {(int(m.group(1)), int(m.group(2))): os.path.join(tag_dir, name)
               for name in names for m in [_EXPERT_FILE.fullmatch(name)] if m}
    return DeepSpeedFiles(tag_dir, tag, universal, model, optim, experts)


def _zero_files(tag_dir: str, names: List[str]) -> Dict[int, Dict[str, Dict[int, str]]]:
    """The ZeRO files: by model-parallel rank (a pipeline's stage), kind, data-parallel rank."""
    out: Dict[int, Dict[str, Dict[int, str]]] = {}
    for name in names:
        match = _ZERO_FILE.fullmatch(name)
        if match:
            kinds = out.setdefault(int(match.group(3)), {})
            kinds.setdefault(match.group(4), {})[int(match.group(2))] = \
                os.path.join(tag_dir, name)
    return out


def _pipeline_files(tag_dir: str, tag: str, names: List[str],
                    layers: Dict[int, str]) -> DeepSpeedFiles:
    """A pipeline's files: each stage's ``mp_rank_<s>_model_states.pt`` and optimizer files,
    the layers' weights. Whether every stage is there is checked against what the stage files
    record (:mod:`._deepspeed_pipe`)."""
    stages = {int(m.group(1)): os.path.join(tag_dir, name)
              for name in names for m in [_STAGE_FILE.fullmatch(name)] if m}
    missing = [s for s in range(max(stages, default=-1) + 1) if s not in stages]
    if missing or not stages:
        raise FileNotFoundError(
            f"{os.path.join(tag_dir, f'mp_rank_{(missing or [0])[0]:02d}_model_states.pt')} is "
            "missing: the DeepSpeed pipeline checkpoint is incomplete; copy every stage's files.")
    zero = _zero_files(tag_dir, names)
    optim = [_rank_order(zero.get(s, {}).get("optim", {}), tag_dir, "optim", s)
             for s in sorted(stages)]
    return DeepSpeedFiles(tag_dir, tag, False, [stages[s] for s in sorted(stages)],
                          [p for stage in optim for p in stage], layers=layers,
                          stage_optim_states=optim)


def _unsupported(name: str, pipeline: bool = False) -> Optional[str]:
    """What a file of a layout the converter does not read stands for (None: a known file);
    ``pipeline``: the tag holds layer files, whose stages are numbered as model-parallel ranks."""
    if re.fullmatch(r"layer_\d+-model_\d+-model_states\.pt", name):
        return "tensor-parallel pipeline (layer_*-model_* files)"
    if pipeline and (_LAYER_FILE.fullmatch(name) or _STAGE_FILE.fullmatch(name)
                     or _ZERO_FILE.fullmatch(name)):
        return None
    mp = re.search(r"mp_rank_(\d+)", name)
    if mp is not None and int(mp.group(1)) != 0:
        return "tensor-parallel (model-parallel rank files other than mp_rank_00)"
    if _EXPERT_FILE.fullmatch(name):
        return None  # a mixture of experts' weights, read beside a ZeRO 1-2 checkpoint
    if name.startswith("layer_"):
        return "pipeline-parallel (unknown layer_* files)"
    if name.startswith("expp_rank_"):
        return "ZeRO stage 0 mixture-of-experts (expp_rank_* optimizer files; stages 1-2 convert)"
    if "expert" in name:
        return "mixture-of-experts (unknown expert files)"
    return None


def _rank_order(by_rank: Dict[int, str], tag_dir: str, kind: str, mp: int = 0) -> List[str]:
    """The files of ranks 0..N-1; a gap is a missing file, named."""
    missing = [r for r in range(max(by_rank, default=-1) + 1) if r not in by_rank]
    if missing:
        name = f"zero_pp_rank_{missing[0]}_mp_rank_{mp:02d}_{kind}_states.pt"
        raise FileNotFoundError(f"{os.path.join(tag_dir, name)} is missing: the DeepSpeed "
                                "checkpoint is incomplete; copy every rank's files.")
    return [by_rank[r] for r in sorted(by_rank)]


# -- reading one file ------------------------------------------------------------------------


def load_pickle(path: str, trust_pickle: bool = False) -> Any:
    """One ``torch.save`` file of a DeepSpeed checkpoint, on the CPU, memory-mapped where torch
    can. Restricted to the allow-list (module docstring) unless ``trust_pickle``."""
    if regular_file(path, os.path.dirname(path)) is None:
        raise FileNotFoundError(f"{path} is missing: the DeepSpeed checkpoint is incomplete; "
                                "copy every file of the tag.")
    mmap = zipfile.is_zipfile(path)  # the format torch.save writes; older files are read
    if trust_pickle:
        return _load(path, mmap, weights_only=False, pickle_module=_TRUSTING)
    with torch.serialization.safe_globals([(c, n) for n, c in STAND_INS.items()]):
        unknown = _unknown_types(path) if mmap else []
        if unknown:
            raise _refused(path, unknown)
        return _load(path, mmap, weights_only=True)


def _load(path: str, mmap: bool, **how: Any) -> Any:
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, **how)
    except pickle.UnpicklingError as error:
        names = re.findall(r"GLOBAL ([\w.]+)", str(error))
        if names:  # a type met while unpickling (a file torch cannot list beforehand)
            raise _refused(path, names) from None
        raise _damaged(path, error) from None
    except (ImportError, AttributeError) as error:  # trust_pickle: a type not importable here
        raise ValueError(f"{path} names a type that cannot be imported here ({error}); install "
                         "the package that defines it, then convert again.") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError) as error:
        raise _damaged(path, error) from None


def _unknown_types(path: str) -> List[str]:
    """Every type the file names that the allow-list lacks, read before any of it is
    unpickled."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except (RuntimeError, ValueError, zipfile.BadZipFile) as error:
        raise _damaged(path, error) from None


def _damaged(path: str, error: Exception) -> ValueError:
    return ValueError(f"{path} cannot be read as a torch.save file ({error}); the DeepSpeed "
                      "checkpoint is damaged or incomplete: copy it again.")


def _refused(path: str, names: List[str]) -> ValueError:
    return ValueError(
        f"{path} holds {', '.join(names)}, which the restricted loader refuses: unpickling an "
        "arbitrary type can run code. If you trust this checkpoint's origin, convert it with "
        "--trust-pickle (import_deepspeed(..., trust_pickle=True)); or, for a type you can "
        "import, allow it first with torch.serialization.add_safe_globals([...]).")


class _TrustingUnpickler(pickle.Unpickler):
    """Full unpickling (``trust_pickle``), with DeepSpeed's own types still given to the
    stand-ins, so a trusted checkpoint converts without DeepSpeed installed."""

    def find_class(self, module: str, name: str) -> Any:
        return STAND_INS.get(f"{module}.{name}") or super().find_class(module, name)


_TRUSTING = types.ModuleType("shardtrain_trusting_pickle")
_TRUSTING.Unpickler = _TrustingUnpickler
_TRUSTING.load = lambda f, **kw: _TrustingUnpickler(f, **kw).load()
_TRUSTING.__dict__.update({k: getattr(pickle, k) for k in ("Pickler", "dump", "dumps", "loads")})
