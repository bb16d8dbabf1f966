"""A Llama-3-style decoder-only transformer in one file, read top to bottom.

RMSNorm -> RoPE -> grouped-query attention -> SwiGLU -> pre-norm blocks -> final norm -> head.
No biases. Each TransformerBlock is self-contained so FSDP2 `fully_shard` can wrap it; the only
shared parameter is the (optional) tied embedding, which lives in the root module.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import MISSING, dataclass, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..config.checks import is_int, is_number
from ..config.errors import ConfigError
from ..config.schema import ModelConfig
from ..distributed.state import to_local
from .loss import chunk_loss_sum, chunked_cross_entropy


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    tie_embeddings: bool = False
    # Llama-3.1 RoPE frequency scaling: {factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings} (HF's `rope_scaling` with rope_type llama3); None: plain RoPE.
    rope_scaling: Mapping[str, float] | None = None

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self):
        for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len"):
            v = getattr(self, k)
            if not is_int(v) or v <= 0:
                raise ConfigError(f"model.{k} must be a positive integer, got {v!r}; set it to e.g. 128.")
        for k in ("norm_eps", "rope_theta"):
            v = getattr(self, k)
            if not is_number(v) or v <= 0:
                raise ConfigError(f"model.{k} must be a positive number, got {v!r}; the usual value is 1e-5 / 10000.0.")
        if not isinstance(self.tie_embeddings, bool):
            raise ConfigError(f"model.tie_embeddings must be true or false, got {self.tie_embeddings!r}.")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}; "
                f"choose n_heads that divides dim (e.g. {self.dim // 64 or 1})."
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}; "
                f"choose n_kv_heads that divides n_heads (e.g. 1 or {self.n_heads})."
            )
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling)
        if self.head_dim % 2:
            raise ConfigError(
                f"head_dim = model.dim / model.n_heads = {self.head_dim} is odd but RoPE needs it even; "
                f"change model.dim or model.n_heads."
            )

    @classmethod
    def from_model(cls, model: ModelConfig) -> LlamaConfig:
        """The shape of the typed ``model`` section (what workers hold); checked as :meth:`from_mapping` does."""
        return cls.from_mapping({f.name: getattr(model, f.name) for f in fields(model)})

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> LlamaConfig:
        """Build from a conf/model yaml mapping (dict or DictConfig); the keys that say how to build
        the model rather than its shape (`name`, `path`, `init`) are ignored."""
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(m, DictConfig):
                m = OmegaConf.to_container(m, resolve=True)
        except ImportError:  # pragma: no cover
            pass
        m = {k: v for k, v in dict(m).items() if k not in BUILD_KEYS}
        known = {f.name for f in fields(cls)}
        for k in m:
            if k not in known:
                raise ConfigError(
                    f"Unknown model config key {k!r}; valid keys are: {', '.join(sorted(known | set(BUILD_KEYS)))}."
                )
        for f in fields(cls):
            if f.default is MISSING and f.name not in m:
                raise ConfigError(f"Missing model config key {f.name!r}; add `{f.name}: <value>` to the model yaml.")
        for k in ("norm_eps", "rope_theta"):  # yaml may give 500000 (int) for a float
            if type(m.get(k)) is int:
                m[k] = float(m[k])
        return cls(**m)


BUILD_KEYS = ("name", "path", "init")  # conf/model keys about building, not the shape
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _check_rope_scaling(rs: Any) -> None:
    if not isinstance(rs, Mapping):
        raise ConfigError(
            f"model.rope_scaling must be null or a mapping with {', '.join(ROPE_SCALING_KEYS)}; got {rs!r}."
        )
    extra = set(rs) - set(ROPE_SCALING_KEYS) - {"rope_type"}
    if extra or rs.get("rope_type", "llama3") != "llama3":
        raise ConfigError(
            f"model.rope_scaling={dict(rs)!r}: only Llama-3 scaling (rope_type llama3 with "
            f"{', '.join(ROPE_SCALING_KEYS)}) is supported."
        )
    for k in ROPE_SCALING_KEYS:
        v = rs.get(k)
        if not is_number(v) or v <= 0:
            raise ConfigError(
                f"model.rope_scaling.{k} must be a positive number, got {v!r} (Llama 3.1 uses "
                f"factor 8, low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192)."
            )
    if rs["high_freq_factor"] <= rs["low_freq_factor"]:
        raise ConfigError(
            f"model.rope_scaling: high_freq_factor={rs['high_freq_factor']} must exceed "
            f"low_freq_factor={rs['low_freq_factor']}."
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **factory):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **factory))

    def forward(self, x):  # normalise in fp32 for stability, return in the input dtype
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_inv_freq(cfg: LlamaConfig, device=None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim/2], fp32, with Llama-3.1 scaling when configured.

    Llama 3 scaling leaves the high frequencies (wavelength < original context / high_freq_factor)
    alone, divides the low ones by `factor`, and interpolates smoothly in between.
    """
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq
    factor, low, high = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
    old_len = float(rs["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(cfg: LlamaConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Real cos/sin tables, shape [max_seq_len, head_dim/2], always fp32."""
    inv_freq = rope_inv_freq(cfg, device)
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x0, x1) of x [B, T, H, hd] by the per-position angle (Meta's layout)."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = cos.float()[:, None, :], sin.float()[:, None, :]  # [T, 1, hd/2] broadcasts over B and H
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, **factory):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False, **factory)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, **factory)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False, **factory)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False, **factory)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, hd]
        # Grouped-query attention: each kv head serves n_heads // n_kv_heads q heads. SDPA's kernels read the
        # shared K/V heads in place (enable_gqa), never a repeat_interleave'd copy of K and V.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):  # SwiGLU: w2(silu(w1 x) * w3 x)
    def __init__(self, cfg: LlamaConfig, **factory):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, **factory)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False, **factory)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False, **factory)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, **factory):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, **factory)
        self.attention = Attention(cfg, **factory)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, **factory)
        self.feed_forward = FeedForward(cfg, **factory)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, *, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        meta = torch.device(device or "cpu").type == "meta"  # no values: nothing to initialise (_init_skipped)
        self.cfg = cfg
        with _init_skipped() if meta else nullcontext():
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, **factory)
            self.layers = nn.ModuleList(TransformerBlock(cfg, **factory) for _ in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps, **factory)
            self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False, **factory)
        # RoPE tables: fp32, not saved in state_dict; recomputed by init_weights (e.g. after meta + to_empty).
        if meta:
            shape = (cfg.max_seq_len, cfg.head_dim // 2)
            cos, sin = (torch.empty(shape, device=device, dtype=torch.float32) for _ in "cs")
        else:
            cos, sin = rope_cos_sin(cfg, device=device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        #: One chunk's loss (:func:`.loss.chunk_loss_sum`); ``train.compile`` puts its compiled form here.
        self.chunk_loss = chunk_loss_sum

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        loss_chunk: int | None = None,
        checkpoint_layers: bool = False,
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab]``; with ``targets``, the mean cross-entropy instead, the head
        applied ``loss_chunk`` positions at a time (see :mod:`.loss`). Computing the loss here,
        inside ``forward``, keeps the head's parameters gathered by FSDP2 for its chunks.
        ``checkpoint_layers`` recomputes each block's activations in the backward pass."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(
                f"Sequence length {T} exceeds model.max_seq_len={self.cfg.max_seq_len}; "
                f"raise model.max_seq_len or shorten the sequences."
            )
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers:
            if checkpoint_layers and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        if targets is not None:
            return chunked_cross_entropy(self._head, h, targets, loss_chunk or T, self.chunk_loss)
        return self._head(h)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection."""
        h = self.norm(h)
        if self.output is None:  # tied: reuse the embedding matrix as the head
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    def reset_rope(self):
        """Recompute the (non-persistent) RoPE buffers in place on their current device."""
        cos, sin = rope_cos_sin(self.cfg, device=self.rope_cos.device)
        self.rope_cos, self.rope_sin = cos, sin

    @torch.no_grad()
    def init_weights(self, seed: int | None = None):
        """Deterministic init: N(0, 0.02), residual projections (wo, w2) N(0, 0.02/sqrt(2*n_layers)), norms 1.

        With a seed the values do not depend on the layout: every parameter is cut into fixed
        blocks of rows (:data:`INIT_BLOCK_ELEMENTS` values each) and block ``b`` of parameter
        ``name`` is drawn from its own CPU generator seeded by ``(seed, name, b)``. A rank
        draws only the blocks that overlap its local shard (FSDP2 DTensor) and keeps its rows,
        so meta-device init costs O(local shard), and any sharding -- or none -- gives bit-identical
        weights. seed=None draws whole tensors from the global torch RNG instead.
        """
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                fill_local_(p, lambda rest, lo, hi: torch.ones(hi - lo, *rest))
                continue
            std = resid_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            if seed is None:
                full = torch.empty(p.shape).normal_(0.0, std)
                fill_local_(p, lambda rest, lo, hi, full=full: full[lo:hi])
            else:
                fill_local_(p, _block_normal(seed, name, std, p.shape))
        self.reset_rope()


INIT_BLOCK_ELEMENTS = 1 << 20  # values per init block: bounds the scratch memory, fixes the RNG streams


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _block_normal(seed: int, name: str, std: float, shape: torch.Size):
    """Rows [lo, hi) of parameter `name`, drawn block by block (see `Llama.init_weights`): yields
    the pieces in order, so that no more than one block is ever held besides the parameter."""
    row_elems = math.prod(shape[1:])
    per_block = max(1, INIT_BLOCK_ELEMENTS // max(row_elems, 1))

    def rows(rest, lo: int, hi: int):
        gen = torch.Generator(device="cpu")
        for b in range(lo // per_block, -(-hi // per_block)):
            b_lo, b_hi = b * per_block, min((b + 1) * per_block, shape[0])
            gen.manual_seed(_block_seed(seed, name, b))
            block = torch.empty(b_hi - b_lo, *rest).normal_(0.0, std, generator=gen)
            yield block[max(lo, b_lo) - b_lo : min(hi, b_hi) - b_lo]

    return rows


def local_slices(p: torch.Tensor) -> tuple[slice, ...]:
    """Index of this rank's piece of parameter ``p`` in the full tensor (everything for a plain tensor)."""
    if _is_dtensor(p):  # FSDP2 turns parameters into DTensors; init_weights fills only the local shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return tuple(slice(0, s) for s in p.shape)


def fill_local_(p: torch.Tensor, rows) -> None:
    """Fill this rank's piece of ``p`` with ``rows(rest_shape, lo, hi)``: rows [lo, hi) of the full
    tensor as one CPU tensor of shape [hi - lo, *rest_shape], or as consecutive pieces of rows (an
    iterator), sliced on the other dims if sharded there."""
    index = local_slices(p)
    local = to_local(p)
    pieces = rows(tuple(p.shape[1:]), index[0].start, index[0].stop)
    if isinstance(pieces, torch.Tensor):
        pieces = (pieces,)
    at = 0
    for piece in pieces:
        local[at : at + piece.shape[0]].copy_(piece[(slice(None), *index[1:])])
        at += piece.shape[0]
    if at != local.shape[0]:
        raise ValueError(f"filled {at} rows of a local shard of {local.shape[0]} rows")


def build_model(model: ModelConfig | LlamaConfig, *, device="cpu", dtype=torch.float32, seed: int | None = 0) -> Llama:
    """Build a Llama from the typed ``model`` section (workers) or a LlamaConfig. On "meta" nothing is
    initialised: call `model.to_empty(device=...)` then `model.init_weights(seed)` later (e.g. after fully_shard).

    A plain conf/model mapping (a YAML file) goes through :meth:`LlamaConfig.from_mapping` first."""
    if isinstance(model, LlamaConfig):
        cfg = model
    elif isinstance(model, ModelConfig):
        cfg = LlamaConfig.from_model(model)
    else:
        raise TypeError(
            f"build_model takes a ModelConfig or a LlamaConfig (LlamaConfig.from_mapping reads a plain "
            f"mapping), got {type(model).__name__}"
        )
    llama = Llama(cfg, device=device, dtype=dtype)
    if torch.device(device).type != "meta":
        llama.init_weights(seed)
    return llama


#: The functions of ``torch.nn.init`` that torch's modules call from their ``reset_parameters``.
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                   "kaiming_normal_", "xavier_uniform_", "xavier_normal_")  # fmt: skip


@contextmanager
def _init_skipped():
    """``torch.nn.init``'s functions as no-ops while :class:`Llama` builds its modules on meta (the pattern of
    transformers' ``no_init_weights``): a meta tensor holds no values, and their meta path imports
    ``torch._dynamo`` (over a second of CPU in a launcher that builds the model only to check the configuration)."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    for name in saved:
        setattr(nn.init, name, _unchanged)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _unchanged(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def _is_dtensor(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor, without importing ``torch.distributed.tensor`` (about half a second of CPU in
    a launcher that builds the model on meta to check the configuration): none exists before that import."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


def count_parameters(model: nn.Module) -> int:
    """Number of parameters; shared (tied) tensors count once, DTensors count their global size."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
