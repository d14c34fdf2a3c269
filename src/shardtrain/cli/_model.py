"""``--model``: what the commands that size a model build, on the meta device.

Two kinds of answer, one resolver for every command:

* a factory, ``MODULE:FACTORY`` (``mypkg.models:build``) or ``path/to/models.py:FACTORY``,
  called under ``torch.device("meta")``;
* a Hugging Face model, as the directory that holds its ``config.json`` or that file itself:
  transformers builds the class ``architectures`` names (``AutoModelForCausalLM`` when it names
  none) from the config under ``torch.device("meta")``, as Accelerate's ``estimate-memory``
  does from a Hub name. Nothing is downloaded, no weight is read, no memory is allocated.

Parameters get shapes and no storage, so a model far larger than the machine is sized in a
second, and a tied weight is one parameter whichever way the model was built.
"""
from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

from ._common import _Failure, _one_line, _UsageError

MODEL_HELP = ("a callable returning an nn.Module (mypkg.models:build, or "
              "path/to/models.py:build), or a Hugging Face model: its directory or its "
              "config.json")
KWARGS_HELP = ("keyword arguments for FACTORY, or fields of config.json to change (e.g. "
               "'{\"num_hidden_layers\": 2}'), as a JSON object")

_FORMS = ("MODULE:FACTORY (mypkg.models:build, path/to/models.py:build), a Hugging Face model "
          "directory holding config.json, or a config.json")


def build_on_meta(spec: str, kwargs: Dict[str, Any]) -> torch.nn.Module:
    """The module ``--model spec`` names, built on the meta device; ``kwargs`` go to the
    factory, or over config.json's fields."""
    config_file = _hf_config_file(spec)
    if config_file is not None:
        return _build_pretrained(spec, config_file, kwargs)
    return _build_from_factory(spec, kwargs)


# -- a Hugging Face config --------------------------------------------------------------------


def _hf_config_file(spec: str) -> Optional[Path]:
    """config.json when ``spec`` names a Hugging Face model; None for a factory."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise _UsageError(f"--model {spec}: the directory holds no config.json; give {_FORMS}")
        return path / "config.json"
    if path.suffix == ".json":
        if not path.is_file():
            raise _UsageError(f"--model: no such file {spec!r}")
        return path
    return None


def _build_pretrained(spec: str, file: Path, overrides: Dict[str, Any]) -> torch.nn.Module:
    transformers = _transformers(spec)
    config = _pretrained_config(transformers, spec, file, overrides)
    cls = _model_class(transformers, spec, config)
    try:
        with torch.device("meta"):
            # a model class takes the config; an Auto class picks one from it
            return cls(config) if issubclass(cls, torch.nn.Module) else cls.from_config(config)
    except Exception as err:  # transformers' code on the user's config: one line, as factories
        raise _Failure(f"building {cls.__name__} from {file} on the meta device failed: "
                       f"{_one_line(err)}") from None


def _transformers(spec: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise _Failure(f"--model {spec} is a Hugging Face config, and building it needs "
                       f"transformers, which this Python lacks: pip install transformers (or "
                       f"give MODULE:FACTORY)") from None
    return transformers


def _pretrained_config(transformers: Any, spec: str, file: Path,
                       overrides: Dict[str, Any]) -> Any:
    """config.json with ``overrides`` over its fields, as the model type's config class reads
    it (derived fields, such as a head size, follow the overrides)."""
    fields = _read_json(spec, file)
    model_type = fields.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise _UsageError(f"--model {spec}: {_unknown_model_type(transformers, file, fields)}")
    config_class = transformers.CONFIG_MAPPING[model_type]
    base = config_class.from_dict(fields)
    unknown = [key for key in overrides if not hasattr(base, key)]
    if unknown:
        near = difflib.get_close_matches(unknown[0], list(base.to_dict()), n=1)
        raise _UsageError(f"--model-kwargs: {config_class.__name__} has no field {unknown[0]!r}"
                          + (f"; did you mean {near[0]!r}?" if near else ""))
    return config_class.from_dict({**fields, **overrides}) if overrides else base


def _read_json(spec: str, file: Path) -> Dict[str, Any]:
    try:
        fields = json.loads(file.read_text(encoding="utf-8"))
    except OSError as err:
        raise _UsageError(f"--model {spec}: cannot read {file}: {err.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _UsageError(f"--model {spec}: {file} is not JSON ({err})") from None
    if not isinstance(fields, dict):
        raise _UsageError(f"--model {spec}: {file} holds {type(fields).__name__}, not the JSON "
                          f"object of a model config")
    return fields


def _unknown_model_type(transformers: Any, file: Path, fields: Dict[str, Any]) -> str:
    model_type = fields.get("model_type")
    if model_type is None:
        return (f"{file} has no model_type, so transformers cannot tell which config it is; "
                f"is it a model's config.json?")
    if "auto_map" in fields:
        return (f"model_type {model_type!r} comes with its own code (auto_map), which "
                f"shardtrain does not run; build the model with a factory (MODULE:FACTORY)")
    return (f"model_type {model_type!r} is unknown to transformers {transformers.__version__}: "
            f"upgrade it (pip install -U transformers), or build the model with a factory "
            f"(MODULE:FACTORY)")


def _model_class(transformers: Any, spec: str, config: Any) -> Any:
    """The class config.json's ``architectures`` names, as from_pretrained builds it; a causal
    LM when it names none (a model of the type with no such head: its base model)."""
    names = getattr(config, "architectures", None) or []
    if names:
        cls = getattr(transformers, names[0], None)
        if cls is None:
            raise _UsageError(f"--model {spec}: architecture {names[0]!r} is not in transformers "
                              f"{transformers.__version__}: upgrade it (pip install -U "
                              f"transformers), or build the model with a factory (MODULE:FACTORY)")
        return cls
    if type(config) in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


# -- a factory --------------------------------------------------------------------------------


def _build_from_factory(spec: str, kwargs: Dict[str, Any]) -> torch.nn.Module:
    factory = _load_factory(spec)
    try:
        with torch.device("meta"):
            model = factory(**kwargs)
    except Exception as err:  # the user's code: report it in one line, as the other errors
        call = f"{spec}(**{kwargs})" if kwargs else f"{spec}()"
        raise _Failure(f"{call} failed on the meta device: {_one_line(err)} (the factory must "
                       f"only build the module: no weight loading, no .item() on "
                       f"parameters)") from None
    if not isinstance(model, torch.nn.Module):
        raise _UsageError(f"--model {spec} returned {type(model).__name__}, not a "
                          f"torch.nn.Module")
    return model


def _load_factory(spec: str) -> Callable[..., Any]:
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise _UsageError(f"--model {spec!r}: expected {_FORMS}. Nothing is downloaded: for a "
                          f"Hub model, fetch its config.json first (hf download NAME "
                          f"config.json --local-dir DIR) and give DIR")
    module = _import_file(where) if where.endswith(".py") else _import_module(where)
    try:
        factory = functools.reduce(getattr, name.split("."), module)
    except AttributeError:
        raise _UsageError(f"--model {spec}: {where} has no attribute {name!r}") from None
    if not callable(factory):
        raise _UsageError(f"--model {spec}: {name} is a {type(factory).__name__}, not a callable")
    return factory


def _import_file(path: str) -> Any:
    file = Path(path).resolve()
    if not file.is_file():
        raise _UsageError(f"--model: no such file {path!r}")
    sys.path.insert(0, str(file.parent))  # its sibling modules import as in `python file.py`
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # a broken model file is the user's code, not a wrong argument
        raise _Failure(f"importing {path} failed: {_one_line(err)}") from None
    return module


def _import_module(name: str) -> Any:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules of this folder import
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is None or not (name == err.name or name.startswith(err.name + ".")):
            raise _Failure(f"importing {name} failed: {_one_line(err)}") from None
        raise _UsageError(f"--model: cannot import {name!r} ({err}); run from the folder that "
                          f"holds it, install its package, or give a path ending in .py") from None
    except Exception as err:  # the module exists but raised: its own bug, not the argument's
        raise _Failure(f"importing {name} failed: {_one_line(err)}") from None
