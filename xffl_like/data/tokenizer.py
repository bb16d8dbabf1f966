"""Tokenizers: ``byte`` (UTF-8 bytes, vocabulary 256) or a Hugging Face ``tokenizer.json``.

``data.tokenizer`` and ``prepare --tokenizer`` take ``byte`` or a path: a ``tokenizer.json``
file, or a directory holding one (an HF model directory), loaded with the ``tokenizers``
library (Rust, no code from the directory runs). :func:`load_tokenizer` returns an object with
``name``, ``vocab_size``, ``eos_id`` and ``encode(text) -> list[int]``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.checks import not_regular
from ..config.errors import ConfigError

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer", "tokenizer_files", "tokenizer_path"]

# Names under which tokenizers commonly store their end-of-document token, most specific first.
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens. The end-of-document token is the NUL byte (id 0): UTF-8 text does
    not contain it, and the vocabulary stays 256."""

    name: str = "byte"
    vocab_size: int = 256
    eos_id: int = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json``; ``eos_id`` from ``tokenizer_config.json``
    (``eos_token``) when beside it, else the first of :data:`EOS_CANDIDATES` in the vocabulary."""

    def __init__(self, file: Path):
        from tokenizers import Tokenizer

        self.name = str(file)
        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # noqa: BLE001 - the Rust library raises its own exception type
            raise ConfigError(f"tokenizer {file}: not a readable tokenizer.json ({exc})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._eos(file)

    def _eos(self, file: Path) -> int | None:
        names = list(EOS_CANDIDATES)
        config = file.parent / "tokenizer_config.json"
        if config.exists():
            try:
                eos = json.loads(config.read_text()).get("eos_token")
            except (OSError, ValueError):
                eos = None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str):
                names.insert(0, eos)
        for name in names:
            token_id = self.tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS templates: documents are joined with eos_id by the caller.
        return self.tok.encode(text, add_special_tokens=False).ids


def tokenizer_path(spec: Any, base_dir: str | os.PathLike | None = None) -> Path | None:
    """The ``tokenizer.json`` that ``spec`` names (None for ``byte``); one-line ConfigError if absent."""
    if spec == "byte":
        return None
    if not isinstance(spec, (str, os.PathLike)) or not str(spec).strip():
        raise ConfigError(f"data.tokenizer={spec!r}: use byte or a path to tokenizer.json or a directory holding it")
    path = Path(spec).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    path = path.absolute()
    file = path / "tokenizer.json" if path.is_dir() else path
    kind = not_regular(file)
    if kind is not None:
        raise ConfigError(
            f"data.tokenizer={spec}: {file} is not a regular file ({kind}); "
            "use byte or a path to tokenizer.json or a directory holding it"
        )
    if not file.is_file():
        raise ConfigError(
            f"data.tokenizer={spec}: no tokenizer.json at {file} "
            "(use byte or a path to tokenizer.json or a directory holding it)"
        )
    return file


def load_tokenizer(spec: Any, base_dir: str | os.PathLike | None = None) -> ByteTokenizer | HFTokenizer:
    """``byte`` or the tokenizer at a path (see :func:`tokenizer_path`)."""
    file = tokenizer_path(spec, base_dir)
    return ByteTokenizer() if file is None else HFTokenizer(file)


def tokenizer_files(spec: Any) -> list[Path]:
    """The files to ship beside exported weights: ``tokenizer.json`` and, when present beside it,
    ``tokenizer_config.json`` and ``special_tokens_map.json``; none for ``byte``."""
    file = tokenizer_path(spec)
    if file is None:
        return []
    extra = [file.parent / n for n in ("tokenizer_config.json", "special_tokens_map.json")]
    return [file, *(p for p in extra if p.is_file())]
