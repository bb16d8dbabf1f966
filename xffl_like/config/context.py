"""What a config check takes besides the job: the :class:`ValidationContext` of
:func:`xffl_like.config.validate.validate_config`, and the one signature of its checks (:data:`Validator`).

Its own module, so that the modules owning a section's meaning (``parallel.options``, ...) can take
the context without importing :mod:`xffl_like.config.validate`, which imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..distributed.layout import Layout
    from ..federation.options import Phase
    from ..models import LlamaConfig
    from .schema import DataConfig, JobConfig, ModelConfig

__all__ = ["ValidationContext", "Validator"]


@dataclass
class ValidationContext:
    """What the launcher knows about the job it validates, and what the checks resolved for the later ones.

    ``world_size`` / ``local_world_size``: the processes of the job and of this node; ``base_dir``: where
    relative paths (``data.path``, ``data.tokenizer``, ``model.path``) resolve. The checks fill in the rest,
    each once: ``layout`` (``layout``), ``phases`` (``federation``), ``model`` and ``shape`` (``model``: the
    section with a Hugging Face directory's path absolute and shape read, and that shape), ``data``
    (``data``: the section with the tokenizer file and the corpus paths resolved).
    """

    world_size: int
    local_world_size: int | None
    base_dir: Path
    layout: Layout | None = None
    phases: list[Phase] | None = None
    model: ModelConfig | None = None
    shape: LlamaConfig | None = None
    data: DataConfig | None = None


#: A check of :data:`xffl_like.config.validate.VALIDATORS`: raises :class:`~xffl_like.config.errors.ConfigError` on the
#: first problem, never rewrites the job (:func:`xffl_like.config.validate.normalise` does, once).
Validator = Callable[["JobConfig", ValidationContext], None]
