"""Pretrained weights into a model at any ZeRO stage: each rank reads only what it keeps.

:func:`load_pretrained` fills a model, or the model an engine trains, from a safetensors file
or a Hugging Face model directory (``model.safetensors``, or sharded
``model-0000N-of-0000M.safetensors`` files with ``model.safetensors.index.json``).

What a rank reads follows what it keeps: at ZeRO stage 3, and in a model built under
:class:`shardtrain.zero.Init` before any engine exists, only the rows of each partitioned
tensor that cover its own shard (a shard is a contiguous range of the flattened tensor, so
that is the shard plus less than one row at each end); at stages 0-2 every rank holds whole
parameters and reads them whole. Nothing but the files' headers and those ranges is read,
and no collective runs: each rank reads its part of the files itself.

The design in three steps, one private module each:

* ``_files``: find the files, read their headers (names, shapes, dtypes), read rows;
* ``_match``: pair the model's ``state_dict`` names with the file's (a tied weight is one
  tensor under several names, loaded once), refuse shape and dtype mismatches and, with
  ``strict``, names that one side lacks, all before any value is read;
* ``_write``: per tensor, read this rank's part and write it in place (the shard of a
  partitioned parameter, or the whole tensor).

When an engine trains the model, the optimizer's copies of the weights (fp32 masters of a
16-bit model, offloaded host copies) are refreshed from the loaded weights, as after
``engine.module.load_state_dict``, so the next step starts from the file's values.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, NamedTuple, Optional, Tuple, Union

import torch

from ..state import RegisteredEngine, live_engines
from ._files import WeightFiles
from ._match import match, refuse_differences, refuse_mismatches
from ._write import load_target, regather

__all__ = ["load_pretrained", "LoadResult"]


class LoadResult(NamedTuple):
    """The names only one side has (as ``torch.nn.Module.load_state_dict`` returns them).

    ``missing_keys``: the model's names the file does not hold (those tensors keep their
    values); ``unexpected_keys``: the file's names the model does not have (never read).
    """

    missing_keys: List[str]
    unexpected_keys: List[str]


def load_pretrained(model: torch.nn.Module, path: Union[str, Path], strict: bool = True
                    ) -> LoadResult:
    """Loads pretrained weights into ``model``; every rank calls it.

    Args:
        model: an engine (``shardtrain.initialize``'s first result), the module an engine
            trains, or a plain module: built normally (each rank reads whole tensors) or
            under ``shardtrain.zero.Init`` (each rank reads only its shards).
        path: a ``.safetensors`` file, a ``model.safetensors.index.json`` file, or a
            Hugging Face model directory holding either.
        strict: refuse the load, before anything is read, when a name of the model's
            ``state_dict`` is not in the file or a name of the file is not in the model.
            With False, the names both have are loaded and the others returned.

    Returns:
        :class:`LoadResult` ``(missing_keys, unexpected_keys)``.

    Raises:
        FileNotFoundError: the path, ``model.safetensors`` or a shard the index names is
            not there.
        ValueError: a name differs under ``strict``; a shape differs; a dtype differs other
            than between floating-point types (those are cast, as ``load_state_dict``
            does); a file is not safetensors. Raised on every rank, before any write.

    Example:
        >>> with shardtrain.zero.Init():
        ...     model = GPT2LMHeadModel(GPT2Config.from_pretrained("ckpt"))
        >>> shardtrain.load_pretrained(model, "ckpt")       # each rank reads its shards
        >>> engine, *_ = shardtrain.initialize(model=model, config=config)
        >>> # or, after initialize, at any stage (the fp32 masters follow):
        >>> missing, unexpected = shardtrain.load_pretrained(engine, "ckpt", strict=False)
    """
    module, engine = _module_and_engine(model)
    with WeightFiles(path) as files:
        found = match(module, files)
        refuse_mismatches(found, files)
        if strict:
            refuse_differences(found, files)
        for target in found.loading:
            load_target(target, files)
    regather(found.loading)
    if engine is not None:
        engine.strategy.refresh_masters([t.tensor for t in found.loading])
    return LoadResult(found.missing, found.unexpected)


def _module_and_engine(model: torch.nn.Module
                       ) -> Tuple[torch.nn.Module, Optional[RegisteredEngine]]:
    """The module to fill and the live engine that trains it, if any."""
    if model in live_engines:  # an engine itself
        return model.module, model
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"load_pretrained(model, ...) needs a torch.nn.Module or an engine, got "
                        f"{type(model).__name__}.")
    return model, live_engines.of_module(model)
