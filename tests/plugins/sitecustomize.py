"""Test-only plugins: what only tests need of a job that runs in its own processes, kept out of ``xffl_like``.

This folder is on ``PYTHONPATH`` of every job a test starts (``helpers.PLUGINS``), so each process of the job
(the launcher, its workers, a facility's leader) runs this file at start-up. It imports every ``hook_*.py``
module beside it when some ``$XFFL_TEST_*`` variable is set, and nothing otherwise; each hook module acts only
when its own variable is set, by wrapping a seam of the shipped code (a module attribute, a constructor
argument's default) before the job imports it.
"""

import importlib
import os
import pkgutil

if any(key.startswith("XFFL_TEST_") for key in os.environ):
    for _info in pkgutil.iter_modules([os.path.dirname(os.path.abspath(__file__))]):
        if _info.name.startswith("hook_"):
            importlib.import_module(_info.name)
