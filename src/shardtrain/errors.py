"""The exceptions shardtrain raises for mistakes DeepSpeed refuses too.

Each derives from the exception Python code would expect of shardtrain (``RuntimeError`` for
a call the engine's state does not allow, ``ValueError`` for a bad argument) *and* from the
class DeepSpeed raises for the same mistake, which is usually an ``AssertionError`` (its
checks are ``assert`` statements). So a script or library written against DeepSpeed, which
catches ``AssertionError`` (or DeepSpeed's ``ValueError``), catches shardtrain's exception
too, and code written against shardtrain catches the class it expects.

Example:
    >>> try:
    ...     with engine.no_sync():
    ...         with engine.no_sync():
    ...             pass
    ... except AssertionError as err:     # as with DeepSpeed; also a RuntimeError
    ...     print(type(err).__name__)
    StepOrderError
"""
from __future__ import annotations

__all__ = ["StepOrderError", "UnusedParametersError", "GradientsUnavailableError",
           "InitializeError", "CheckpointTagError", "PipelineError"]


class StepOrderError(RuntimeError, AssertionError):
    """A call the training step does not allow where it was made: ``no_sync()`` at ZeRO
    stages 2-3 or inside another ``no_sync()``, ``step()`` inside ``no_sync()``."""


class UnusedParametersError(RuntimeError, AssertionError):
    """Trainable parameters got no gradient on any rank during a step, and
    ``zero_optimization.ignore_unused_parameters`` is false."""


class GradientsUnavailableError(RuntimeError, ValueError):
    """A parameter's gradient was asked for where the engine holds none to give (DeepSpeed
    raises ``ValueError`` there)."""


class InitializeError(ValueError, AssertionError):
    """``initialize()`` lacks what it needs (a model, a config) or was given two configs."""


class CheckpointTagError(ValueError, AssertionError):
    """Ranks passed different tags to ``save_checkpoint`` and
    ``checkpoint.tag_validation`` is ``"Fail"``."""


class PipelineError(RuntimeError):
    """A pipeline-parallel model used in a way its stages cannot run (DeepSpeed's
    ``deepspeed.runtime.pipe.module.PipelineError``)."""
