"""Shared pytest set-up."""
import sys
from pathlib import Path

# Make the repository's examples/ importable (``import gpt``).
_EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
