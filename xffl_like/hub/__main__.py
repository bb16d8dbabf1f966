"""``python -m xffl_like.hub {init,add,revoke,serve}``: see :mod:`xffl_like.hub.cli`."""

import sys

from .cli import main

sys.exit(main())
