"""``python -m shardtrain.cli``: the ``shardtrain`` command without its console script."""
import sys

from . import main

sys.exit(main())
