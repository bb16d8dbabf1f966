"""The file names and format tag of a corpus written by ``python -m xffl_like.data.prepare``.

Their own module so that :mod:`.tokens` (imported by the package) does not import :mod:`.prepare`:
``python -m xffl_like.data.prepare`` would then find its module already imported by the package
and runpy warns (``RuntimeWarning: 'xffl_like.data.prepare' found in sys.modules``) on every run.
"""

from __future__ import annotations

__all__ = ["FORMAT", "META", "TOKENS"]

META, TOKENS, FORMAT = "meta.json", "tokens.bin", "xffl_like.tokens/1"
