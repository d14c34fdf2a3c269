"""``deepspeed.comm``: DeepSpeed's communication functions (see :mod:`.comm`)."""
from .comm import *  # noqa: F401,F403 - the package is the module, as in DeepSpeed
from .comm import __all__  # noqa: F401
