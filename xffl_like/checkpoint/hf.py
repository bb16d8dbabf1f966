"""Hugging Face Llama checkpoints in and out: ``config.json`` + safetensors, never pickles.

Import (``model=hf model.path=DIR``): :func:`read_hf_config` turns ``config.json`` into our
``conf/model`` keys (in the launcher, before workers start; :func:`check_hf_weights` reads the
safetensors headers only), then every worker fills its own FSDP2 shards with
:func:`load_hf_weights`, reading just its rows through safetensors' lazy ``get_slice``.

Export (``export.hf=true``): :func:`export_hf` gathers one parameter at a time inside the
first facility's first replica; rank 0 writes it into safetensors files of at most
``max_shard_bytes`` (plus the index when there are several) and ``config.json``.

Names: ours ``layers.i.attention.wq.weight`` is HF's ``model.layers.i.self_attn.q_proj.weight``
and so on (:func:`hf_name`). Our RoPE rotates consecutive pairs (Meta's layout), HF's rotates
the two halves of each head, so q/k rows are permuted within each head on the way in and out
(the same permutation as transformers' ``convert_llama_weights_to_hf``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config.checks import not_regular
from ..config.errors import ConfigError
from ..config.schema import DataConfig, ExportConfig
from ..models.llama import LlamaConfig, fill_local_

__all__ = [
    "HF_SUFFIXES",
    "check_hf_weights",
    "export_hf",
    "export_job",
    "hf_config",
    "hf_name",
    "load_hf_weights",
    "read_hf_config",
    "weight_files",
]

READ_ELEMENTS = 1 << 24  # values read per get_slice call (64 MB in fp32)
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# our suffix inside a block -> HF's
HF_SUFFIXES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """HF name of our parameter ``name``
    (``layers.3.attention.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    if name in TOP:
        return TOP[name]
    _, index, suffix = name.split(".", 2)
    return f"model.layers.{index}.{HF_SUFFIXES[suffix]}"


def _rope_heads(name: str, cfg: LlamaConfig) -> int | None:
    """Number of heads whose rows are permuted between the two RoPE layouts (q and k), else None."""
    if name.endswith("attention.wq.weight"):
        return cfg.n_heads
    if name.endswith("attention.wk.weight"):
        return cfg.n_kv_heads
    return None


def to_hf_layout(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from consecutive pairs (ours) to halves (HF)."""
    return w.reshape(heads, -1, 2, w.shape[-1]).transpose(1, 2).reshape(w.shape)


def from_hf_layout(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`to_hf_layout` (``heads`` whole heads of rows)."""
    return w.reshape(heads, 2, -1, w.shape[-1]).transpose(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------- config.json
def _fail(path: Path, why: str) -> ConfigError:
    return ConfigError(f"model.path={path}: {why}")


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """Our ``conf/model`` keys from ``<path>/config.json`` of a ``LlamaForCausalLM``.

    Reads both spellings of RoPE: transformers 4's ``rope_theta`` + ``rope_scaling`` and
    transformers 5's ``rope_parameters``. Anything our Llama cannot represent is refused
    (:class:`~xffl_like.config.errors.ConfigError`, one line).
    """
    try:
        return _read_hf_config(Path(path))
    except ConfigError:
        raise
    except ValueError as exc:  # a value of config.json that is not a number: Python's own line
        raise ConfigError(str(exc)) from None


def _read_hf_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise _fail(path, "not a directory (pass model.path=<local Hugging Face model directory>)")
    file = path / "config.json"
    kind = not_regular(file)
    if kind is not None:  # before reading: a device or /proc file never ends or changes
        raise _fail(path, f"config.json is not a regular file ({kind}); pass the directory written by save_pretrained")
    try:
        hf = json.loads(file.read_text())
    except FileNotFoundError:
        raise _fail(path, "no config.json (pass the directory written by save_pretrained)") from None
    except (OSError, ValueError) as exc:
        raise _fail(path, f"config.json is unreadable: {exc}") from None
    arch = hf.get("architectures") or []
    if "LlamaForCausalLM" not in arch and hf.get("model_type") != "llama":
        raise _fail(path, f"architecture {arch or hf.get('model_type')!r} is not LlamaForCausalLM")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise _fail(path, "only SiLU activations without attention/MLP biases are supported (Llama 3)")
    try:
        dim, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        out = {
            "dim": dim,
            "n_layers": int(hf["num_hidden_layers"]),
            "n_heads": heads,
            "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
            "vocab_size": int(hf["vocab_size"]),
            "ffn_dim": int(hf["intermediate_size"]),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }
    except KeyError as exc:
        raise _fail(path, f"config.json lacks {exc.args[0]!r}") from None
    if hf.get("head_dim") not in (None, dim // heads):
        raise _fail(path, f"head_dim={hf['head_dim']} differs from hidden_size/num_attention_heads={dim // heads}")
    rope = hf.get("rope_parameters")  # transformers 5
    if not isinstance(rope, dict):
        rope = dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", 10000.0))  # transformers 4
    kind = rope.get("rope_type", rope.get("type", "default"))
    out["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in rope]
        if missing:
            raise _fail(path, f"rope_scaling of type llama3 lacks {', '.join(missing)}")
        out["rope_scaling"] = {
            k: float(rope[k]) if k != "original_max_position_embeddings" else int(rope[k]) for k in keys
        }
    elif kind == "default":
        out["rope_scaling"] = None
    else:
        raise _fail(path, f"rope type {kind!r} is not supported (only default and llama3)")
    try:
        LlamaConfig(**out)
    except ValueError as exc:
        raise _fail(path, str(exc)) from None
    return out


def weight_files(path: str | os.PathLike) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (single file or sharded with index)."""
    path = Path(path)
    index = path / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise _fail(path, f"{INDEX} is unreadable: {exc}") from None
        return {name: path / file for name, file in weight_map.items()}
    if (path / SINGLE).exists():
        from safetensors import safe_open

        try:
            with safe_open(path / SINGLE, framework="pt") as f:
                return {name: path / SINGLE for name in f.keys()}
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise _fail(path, f"{SINGLE} is not a readable safetensors file ({exc})") from None
    if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
        raise _fail(
            path,
            "holds only PyTorch pickle weights (*.bin); pickles can run code and are refused: "
            "convert them to safetensors (save_pretrained(dir, safe_serialization=True))",
        )
    raise _fail(path, f"neither {SINGLE} nor {INDEX} found")


def _expected(cfg: LlamaConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Our parameter name -> (HF name, shape), from a model built on meta."""
    from ..models import build_model

    model = build_model(cfg, device="meta")
    return {n: (hf_name(n), tuple(p.shape)) for n, p in model.named_parameters()}


def check_hf_weights(path: str | os.PathLike, cfg: LlamaConfig) -> None:
    """Every tensor the model needs is present with its shape (headers only; in the launcher)."""
    from safetensors import safe_open

    files = weight_files(path)
    by_file: dict[Path, list[tuple[str, tuple[int, ...]]]] = {}
    for _, (name, shape) in _expected(cfg).items():
        if name not in files:
            raise _fail(Path(path), f"tensor {name} is missing from the safetensors files")
        by_file.setdefault(files[name], []).append((name, shape))
    for file, wanted in by_file.items():
        try:
            with safe_open(file, framework="pt") as f:
                for name, shape in wanted:
                    got = tuple(f.get_slice(name).get_shape())
                    if got != shape:
                        raise _fail(
                            Path(path), f"tensor {name} has shape {list(got)}, config.json implies {list(shape)}"
                        )
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _fail(Path(path), f"{file.name} is not a readable safetensors file ({exc})") from None


# --------------------------------------------------------------------------- import
@torch.no_grad()
def load_hf_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Fill ``model`` (plain or FSDP2-sharded, materialised) from the HF checkpoint in ``path``.

    Each parameter's local rows are read with ``get_slice`` (q/k: the whole heads that cover
    them, then permuted and trimmed), so a rank reads its shard and nothing else.
    """
    from safetensors import safe_open

    cfg: LlamaConfig = model.cfg
    files = weight_files(path)
    handles: dict[Path, Any] = {}
    try:
        for name, p in model.named_parameters():
            src = hf_name(name)
            file = files[src]
            if file not in handles:
                handles[file] = safe_open(file, framework="pt")
            tensor = handles[file].get_slice(src)
            heads = _rope_heads(name, cfg)

            def rows(rest, lo, hi, tensor=tensor, heads=heads):
                if heads is None:  # pieces of at most READ_ELEMENTS values: bounded scratch memory
                    step = max(1, READ_ELEMENTS // max(1, math.prod(rest)))
                    return (tensor[a : min(a + step, hi)] for a in range(lo, hi, step))
                if hi <= lo:
                    return tensor[lo:hi]
                hd = cfg.head_dim  # q/k: read the whole heads covering [lo, hi), permute, keep [lo, hi)
                h0, h1 = lo // hd, -(-hi // hd)
                block = from_hf_layout(tensor[h0 * hd : h1 * hd], h1 - h0)
                return block[lo - h0 * hd : hi - h0 * hd]

            fill_local_(p, rows)
    finally:
        handles.clear()
    model.reset_rope()


# --------------------------------------------------------------------------- export
def hf_config(cfg: LlamaConfig, base: dict | None = None) -> dict[str, Any]:
    """``config.json`` for ``cfg``; keys of ``base`` (the imported model's config) that do not
    describe the shape (token ids, ...) are kept."""
    out = {k: v for k, v in (base or {}).items() if k not in ("rope_scaling", "rope_parameters", "rope_theta")}
    out.update(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": cfg.dim,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.ffn_dim,
            "vocab_size": cfg.vocab_size,
            "rms_norm_eps": cfg.norm_eps,
            "max_position_embeddings": cfg.max_seq_len,
            "tie_word_embeddings": cfg.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "dtype": "float32",
        }
    )
    # transformers 5 spelling; transformers >= 4.x also reads rope_theta/rope_scaling, written for older readers.
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        rope.update(dict(cfg.rope_scaling), rope_type="llama3")
    out["rope_parameters"] = rope
    return out


class _ShardWriter:
    """Accumulates tensors into safetensors files of at most ``max_bytes`` (rank 0 only)."""

    def __init__(self, out_dir: Path, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        file = self.out_dir / f".part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(file), metadata={"format": "pt"})
        self.files.append((file, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Name the files ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` (+ index)."""
        self.flush()
        n = len(self.files)
        if n == 1:
            self.files[0][0].replace(self.out_dir / SINGLE)
            return [SINGLE]
        weight_map, names = {}, []
        for k, (file, tensors) in enumerate(self.files, start=1):
            final = f"model-{k:05d}-of-{n:05d}.safetensors"
            file.replace(self.out_dir / final)
            names.append(final)
            weight_map.update({t: final for t in tensors})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / INDEX).write_text(json.dumps(index, indent=2))
        return names


@torch.no_grad()
def export_hf(
    model: nn.Module,
    state,
    out_dir: str | os.PathLike,
    *,
    base_config: dict | None = None,
    max_shard_bytes: int = 2 * 10**9,
) -> None:
    """Write ``model`` as a HF ``LlamaForCausalLM`` directory (a collective over facility 0, replica 0).

    Facilities agree after the last aggregation, so one sharding's ranks gather each parameter
    in turn (``full_tensor``) and rank 0 writes it: no rank holds more than one parameter plus
    one file's worth (``max_shard_bytes``) at a time. Every rank returns after a barrier.
    """
    cfg: LlamaConfig = model.cfg
    out = Path(out_dir)
    writes = state.rank == 0
    if writes:
        out.mkdir(parents=True, exist_ok=True)
        writer = _ShardWriter(out, max_shard_bytes)
    if state.facility == 0 and state.replica == 0:
        for name, p in model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if not writes:
                del full
                continue
            heads = _rope_heads(name, cfg)
            full = full.detach().to("cpu", torch.float32)
            full = to_hf_layout(full, heads) if heads is not None else full
            writer.add(hf_name(name), full.contiguous().clone())
    if writes:
        writer.close()
        (out / "config.json").write_text(json.dumps(hf_config(cfg, base_config), indent=2, sort_keys=True) + "\n")
    dist.barrier()


def export_job(
    model: nn.Module,
    state,
    run_dir: str | os.PathLike,
    export: ExportConfig,
    data: DataConfig,
    base_model: str | None = None,
) -> Path:
    """``export.hf=true`` at the end of a job: ``<run_dir>/hf/`` with the weights (files of at most
    ``export.max_shard_mb``), ``config.json`` (token ids and other non-shape keys of the model imported from
    ``base_model``, the job's ``model.path``, kept) and the tokenizer files (``data.tokenizer``, or for
    ``data=tokens`` the one ``prepare`` recorded) unless it is ``byte``, so that transformers loads model and
    tokenizer from it."""
    out = Path(run_dir) / "hf"
    base = None
    if base_model:
        base = json.loads((Path(base_model) / "config.json").read_text())
    export_hf(model, state, out, base_config=base, max_shard_bytes=int(export.max_shard_mb * 2**20))
    if state.rank == 0:
        from ..data.tokenizer import tokenizer_files

        spec = data.tokenizer
        if data.name == "tokens":  # the tokenizer that prepare recorded
            from ..data.tokens import read_meta

            spec = read_meta(Path(data.path))["tokenizer"]
        try:
            for file in tokenizer_files(spec):
                shutil.copyfile(file, out / file.name)
        except ValueError as exc:  # moved since the corpus was prepared: the weights are written anyway
            print(f"note: tokenizer not exported: {exc}", flush=True)
        if (out / "tokenizer.json").exists() and not (out / "tokenizer_config.json").exists():
            from ..data.tokenizer import load_tokenizer

            tok = load_tokenizer(out / "tokenizer.json")
            if tok.eos_id is not None:  # so that AutoTokenizer knows the end-of-document token
                eos = tok.tok.id_to_token(tok.eos_id)
                (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}) + "\n")
    return out
