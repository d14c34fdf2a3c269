"""The batch triple: DeepSpeed's rules for deriving the missing batch keys, and the check that
``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``.

The rules, their floor divisions and the order of the checks are DeepSpeed's, so a config resolves
to the same numbers under both engines. Each derivation is recorded, so that an error can show
where a number came from and which values would be consistent.
"""

from typing import Dict, Optional, Tuple

from ._model import ConfigError

#: The keys of the triple: null (or absent) means "derive it".
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _resolve_batch(tb: Optional[int], mb: Optional[int], gas: Optional[int], ws: int) -> Tuple[int, int, int]:
    """Derive the missing batch keys and check TB == MB * GAS * ws.

    The first matching rule applies: all three given; TB and MB; TB and GAS; MB and GAS; only TB;
    only MB. ``how`` records each derivation so an error can show where a number came from.
    """
    tb, mb, gas, how = _derive_batch(tb, mb, gas, ws)
    _check_positive(tb, mb, gas, ws, how)
    _check_product(tb, mb, gas, ws, how)
    return tb, mb, gas


def _derive_batch(tb: Optional[int], mb: Optional[int], gas: Optional[int],
                  ws: int) -> Tuple[int, int, int, Dict[str, str]]:
    """The triple with its missing keys derived, and how each derived one was computed."""
    how: Dict[str, str] = {}
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = (tb // mb) // ws
        how["gas"] = f"train_batch_size {tb} // train_micro_batch_size_per_gpu {mb} // world_size {ws}"
    elif tb is not None and gas is not None:
        mb = (tb // ws) // gas
        how["mb"] = f"train_batch_size {tb} // world_size {ws} // gradient_accumulation_steps {gas}"
    elif mb is not None and gas is not None:
        tb = mb * gas * ws
        how["tb"] = f"train_micro_batch_size_per_gpu {mb} * gradient_accumulation_steps {gas} * world_size {ws}"
    elif tb is not None:
        gas, mb = 1, tb // ws
        how["mb"] = f"train_batch_size {tb} // world_size {ws}"
    elif mb is not None:
        tb, gas = mb * ws, 1
        how["tb"] = f"train_micro_batch_size_per_gpu {mb} * world_size {ws}"
    else:
        raise _no_batch_size(gas)
    return tb, mb, gas, how


def _no_batch_size(gas: Optional[int]) -> ConfigError:
    given = " (gradient_accumulation_steps alone is not enough)" if gas is not None else ""
    return ConfigError(
        f"Neither train_batch_size nor train_micro_batch_size_per_gpu is set{given}. Give "
        "train_micro_batch_size_per_gpu (samples per forward/backward on one rank), train_batch_size (samples "
        "per optimizer step over all ranks), or both; gradient_accumulation_steps is derived when missing.")


def _check_positive(tb: int, mb: int, gas: int, ws: int, how: Dict[str, str]) -> None:
    for name, short, value in (("train_batch_size", "tb", tb), ("train_micro_batch_size_per_gpu", "mb", mb),
                               ("gradient_accumulation_steps", "gas", gas)):
        if value <= 0:
            origin = f" (derived as {how[short]}, floor division)" if short in how else ""
            advice = _batch_advice(short, tb, mb, gas, ws)
            raise ConfigError(f"{name} {value}{origin} has to be greater than 0. {advice}")


def _check_product(tb: int, mb: int, gas: int, ws: int, how: Dict[str, str]) -> None:
    if tb != mb * gas * ws:
        origin = "".join(f"; {key} derived as {text}" for key, text in
                         (("gradient_accumulation_steps", how.get("gas")),
                          ("train_micro_batch_size_per_gpu", how.get("mb"))) if text)
        raise ConfigError(
            f"train_batch_size {tb} != train_micro_batch_size_per_gpu {mb} * gradient_accumulation_steps {gas} "
            f"* world_size {ws} (= {mb * gas * ws}){origin}. {_consistent_advice(tb, mb, gas, ws, how)}")


def _batch_advice(short: str, tb: int, mb: int, gas: int, ws: int) -> str:
    if short == "mb" and tb > 0 and gas > 0:
        return (f"Make train_batch_size at least world_size * gradient_accumulation_steps = {ws * gas}, or set "
                "train_micro_batch_size_per_gpu.")
    if short == "gas" and tb > 0 and mb > 0:
        return f"Make train_batch_size at least train_micro_batch_size_per_gpu * world_size = {mb * ws}."
    return "Set every batch key to a positive integer."


def _consistent_advice(tb: int, mb: int, gas: int, ws: int, how: Dict[str, str]) -> str:
    if "gas" in how:
        unit, what = mb * ws, f"train_micro_batch_size_per_gpu * world_size = {mb * ws}"
    elif "mb" in how:
        unit, what = gas * ws, f"gradient_accumulation_steps * world_size = {gas * ws}"
    else:
        return (f"Set train_batch_size to {mb * gas * ws}, or give only two of the three keys and let "
                "shardtrain derive the third.")
    lower = (tb // unit) * unit
    options = " or ".join(str(value) for value in (lower, lower + unit) if value > 0)
    return f"train_batch_size must be a multiple of {what}: use {options}."
