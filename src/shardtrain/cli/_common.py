"""What the ``shardtrain`` commands share: their two kinds of error, argument types that
name a bad value, the default process count, and number formatting."""
from __future__ import annotations

import argparse

from .. import accelerator


class _UsageError(Exception):
    """A wrong argument: printed as one line under the subcommand's usage (exit status 2)."""


class _Failure(Exception):
    """The arguments were fine but the work failed: printed as one line (exit status 1)."""


# -- argument types: a bad value is an argparse error that names the option ---------------------


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _plural(n: int, word: str, words: str = "") -> str:
    return f"{n} {word if n == 1 else (words or word + 's')}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _default_nproc() -> int:
    try:
        cuda = accelerator.is_cuda()
    except (ValueError, RuntimeError) as err:
        raise _Failure(str(err)) from None
    # One process per GPU, like torchrun's --nproc-per-node gpu; one on a CPU-only machine.
    return accelerator.device_count() if cuda else 1
