"""The file names and format tag of a corpus written by ``python -m xffl_like.data.prepare``.

Their own module so that :mod:`.tokens` (imported by the package) does not import :mod:`.prepare`:
``python -m xffl_like.data.prepare`` would then find its module already imported by the package
and runpy warns (``RuntimeWarning: 'xffl_like.data.prepare' found in sys.modules``) on every run.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["FORMAT", "META", "TOKENS", "output_for"]

META, TOKENS, FORMAT = "meta.json", "tokens.bin", "xffl_like.tokens/1"


def output_for(path: str | Path) -> Path:
    """A directory for the prepared corpus of the text file ``path`` that is not ``path`` itself:
    ``corpus.txt`` -> ``corpus-tokens`` (what fix hints suggest as ``--output``)."""
    path = Path(path)
    return path.with_name(f"{path.stem or path.name}-tokens")
