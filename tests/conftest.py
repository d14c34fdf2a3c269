"""Shared pytest set-up."""
import logging
import sys
from pathlib import Path

import pytest

# Make the repository's examples/ importable (``import gpt``).
_EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)


@pytest.fixture
def records():
    """Records of the shardtrain logger (it does not propagate to pytest's caplog)."""
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger("shardtrain")
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)
