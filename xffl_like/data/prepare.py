"""``python -m xffl_like.data.prepare --tokenizer <path|byte> --output <dir> <files...>``

Tokenizes text once, ahead of training, into ``<dir>/tokens.bin`` (a flat array of uint16
token ids, uint32 when the vocabulary exceeds 65,536) and ``<dir>/meta.json`` (tokenizer,
dtype, token count, document boundaries). Documents are the input files (``.jsonl`` files:
one document per line, its ``"text"`` field), each followed by the tokenizer's EOS token.
``data=tokens data.path=<dir>`` then trains on it without tokenizing again.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..config.checks import not_regular
from .corpus_format import FORMAT, META, TOKENS, output_for
from .tokenizer import load_tokenizer

__all__ = ["META", "TOKENS", "FORMAT", "output_for", "prepare", "main"]


def _documents(path: Path) -> Iterator[str]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if line.strip():
                    try:
                        yield json.loads(line)["text"]
                    except (ValueError, KeyError, TypeError):
                        raise ValueError(f'{path}:{n}: not a JSON object with a "text" field') from None
    else:
        try:
            yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 text (invalid byte at offset {exc.start})") from None


def _check_inputs(paths: list[Path], out: Path) -> None:
    """Every input a regular, non-empty file, none of them overwritten by what ``out`` will hold."""
    for p in paths:
        kind = not_regular(p)
        if kind is not None:
            raise ValueError(f"{p}: not a regular file ({kind}); pass UTF-8 text or .jsonl files")
        if not p.is_file():
            raise ValueError(f"{p}: no such file")
        if p.stat().st_size == 0:
            raise ValueError(f"{p}: the file is empty, nothing to tokenize; pass files with text")
    written = [out / TOKENS, out / META, out / (TOKENS + ".partial")]
    inputs = {p.resolve(): p for p in paths}
    for target in [out, *written]:
        if target.resolve() in inputs:
            p = inputs[target.resolve()]
            raise ValueError(
                f"--output {out}: would overwrite the input {p}; write the corpus to another "
                f"directory, e.g. --output {output_for(p)}"
            )
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {out}: exists and is not a directory; pass a directory (it is created if missing)")


def _tokenizer_with_eos(tokenizer: str):
    """The tokenizer ``tokenizer`` (a path or ``byte``), which must have an end-of-document token."""
    tok = load_tokenizer(tokenizer, Path.cwd())
    if tok.eos_id is None:
        raise ValueError(
            f"tokenizer {tok.name}: no end-of-document token found (add one of "
            "<|end_of_text|>, <|endoftext|>, </s> or set eos_token in tokenizer_config.json)"
        )
    return tok


def _write_documents(f, paths: list[Path], tok, dtype, bar) -> tuple[list[int], int]:
    """Write every document of ``paths`` to ``f`` as tokens, each followed by the end-of-document token;
    return each document's first token index and the number of tokens."""
    starts: list[int] = []
    count = 0
    for p in paths:
        empty = True
        for text in _documents(p):
            empty = empty and not text.strip()
            ids = np.asarray(tok.encode(text) + [tok.eos_id], dtype=dtype)
            starts.append(count)
            count += len(ids)
            f.write(ids.tobytes())
            bar.update(len(text.encode("utf-8")))
        if empty:  # whitespace only, or a .jsonl without a document: a corpus of end-of-document tokens
            raise ValueError(f"{p}: no text to tokenize (only whitespace or no documents); pass files with text")
    return starts, count


def prepare(tokenizer: str, output: str | Path, files: list[str | Path], progress: bool = True) -> dict:
    """Write ``tokens.bin`` + ``meta.json`` under ``output``; return the metadata."""
    paths = [Path(f).absolute() for f in files]
    out = Path(output).absolute()
    _check_inputs(paths, out)
    tok = _tokenizer_with_eos(tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--output {out}: cannot create the directory ({exc.strerror or exc})") from None
    from tqdm import tqdm

    bar = tqdm(
        total=sum(p.stat().st_size for p in paths),
        unit="B",
        unit_scale=True,
        desc="tokenizing",
        disable=not progress,
        file=sys.stderr,
    )
    partial = out / (TOKENS + ".partial")  # renamed at the end: an interrupted run leaves no valid-looking corpus
    try:
        with partial.open("wb") as f:
            starts, count = _write_documents(f, paths, tok, dtype, bar)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise ValueError(f"{partial}: cannot write ({exc.strerror or exc})") from None
    except ValueError:
        partial.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    partial.replace(out / TOKENS)
    meta = {
        "format": FORMAT,
        "tokenizer": "byte" if tok.name == "byte" else str(Path(tok.name).absolute()),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": np.dtype(dtype).name,
        "num_tokens": count,
        "files": [str(p) for p in paths],
        "document_starts": starts,
    }
    (out / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xffl_like.data.prepare", description=__doc__.split("\n\n")[1])
    parser.add_argument("--tokenizer", default="byte", help="byte, a tokenizer.json, or a directory holding one")
    parser.add_argument("--output", required=True, help="directory for tokens.bin and meta.json")
    parser.add_argument("files", nargs="+", help="UTF-8 text files (one document each) or .jsonl files")
    args = parser.parse_args(argv)
    try:
        meta = prepare(args.tokenizer, args.output, args.files)
    except (ValueError, OSError) as exc:  # OSError: meta.json could not be written (a full disk, permissions)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {meta['num_tokens']:,} tokens ({meta['dtype']}, {len(meta['document_starts'])} documents, "
        f"vocabulary {meta['vocab_size']}) to {Path(args.output) / TOKENS}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
