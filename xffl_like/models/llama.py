"""A Llama-3-style decoder-only transformer in one file, read top to bottom.

RMSNorm -> RoPE -> grouped-query attention -> SwiGLU -> pre-norm blocks -> final norm -> head.
No biases. Each TransformerBlock is self-contained so FSDP2 `fully_shard` can wrap it; the only
shared parameter is the (optional) tied embedding, which lives in the root module.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .loss import chunked_cross_entropy

try:  # FSDP2 turns parameters into DTensors; init_weights fills only the local shard.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None


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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self):
        for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"model.{k} must be a positive integer, got {v!r}; set it to e.g. 128.")
        for k in ("norm_eps", "rope_theta"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"model.{k} must be a positive number, got {v!r}; the usual value is 1e-5 / 10000.0.")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"model.tie_embeddings must be true or false, got {self.tie_embeddings!r}.")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}; "
                             f"choose n_heads that divides dim (e.g. {self.dim // 64 or 1}).")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}; "
                             f"choose n_kv_heads that divides n_heads (e.g. 1 or {self.n_heads}).")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = model.dim / model.n_heads = {self.head_dim} is odd but RoPE needs it even; "
                             f"change model.dim or model.n_heads.")

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "LlamaConfig":
        """Build from a conf/model yaml mapping (dict or DictConfig); the key `name` is ignored."""
        try:
            from omegaconf import DictConfig, OmegaConf
            if isinstance(m, DictConfig):
                m = OmegaConf.to_container(m, resolve=True)
        except ImportError:  # pragma: no cover
            pass
        m = {k: v for k, v in dict(m).items() if k != "name"}
        known = {f.name for f in fields(cls)}
        for k in m:
            if k not in known:
                raise ValueError(f"Unknown model config key {k!r}; valid keys are: name, {', '.join(sorted(known))}.")
        for f in fields(cls):
            if f.default is MISSING and f.name not in m:
                raise ValueError(f"Missing model config key {f.name!r}; add `{f.name}: <value>` to the model yaml.")
        for k in ("norm_eps", "rope_theta"):  # yaml may give 500000 (int) for a float
            if type(m.get(k)) is int:
                m[k] = float(m[k])
        return cls(**m)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **factory):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **factory))

    def forward(self, x):  # normalise in fp32 for stability, return in the input dtype
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_cos_sin(cfg: LlamaConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Real cos/sin tables, shape [max_seq_len, head_dim/2], always fp32."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
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
        rep = self.n_heads // self.n_kv_heads  # grouped-query attention: each kv head serves `rep` q heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
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
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, **factory)
        self.layers = nn.ModuleList(TransformerBlock(cfg, **factory) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, **factory)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False, **factory)
        # RoPE tables: fp32, not saved in state_dict; recomputed by init_weights (e.g. after meta + to_empty).
        cos, sin = rope_cos_sin(cfg, device=device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                loss_chunk: int | None = None, checkpoint_layers: bool = False) -> torch.Tensor:
        """Logits ``[B, T, vocab]``; with ``targets``, the mean cross-entropy instead, the head
        applied ``loss_chunk`` positions at a time (see :mod:`.loss`). Computing the loss here,
        inside ``forward``, keeps the head's parameters gathered by FSDP2 for its chunks.
        ``checkpoint_layers`` recomputes each block's activations in the backward pass."""
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"Sequence length {T} exceeds model.max_seq_len={self.cfg.max_seq_len}; "
                             f"raise model.max_seq_len or shorten the sequences.")
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers:
            if checkpoint_layers and torch.is_grad_enabled():
                h = checkpoint(layer, h, cos, sin, use_reentrant=False)
            else:
                h = layer(h, cos, sin)
        if targets is not None:
            return chunked_cross_entropy(self._head, h, targets, loss_chunk or T)
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

        Every value is drawn from a CPU generator in a fixed parameter order on the *full* tensor, then
        copied (only the local shard, for FSDP2 DTensors) to the parameter's device and dtype, so the
        same seed gives bit-identical weights on any process, device and sharding. seed=None draws
        from the global torch RNG instead.
        """
        gen = None
        if seed is not None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                full = torch.ones(p.shape)
            else:
                std = resid_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                full = torch.empty(p.shape).normal_(0.0, std, generator=gen)
            _copy_full_(p, full)
        self.reset_rope()


def _copy_full_(p: torch.Tensor, full: torch.Tensor):
    """Copy a full (unsharded) CPU tensor into p; for a DTensor only this rank's slice is copied."""
    if DTensor is not None and isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(full.shape, p.device_mesh, p.placements)
        full = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        p = p.to_local()
    p.copy_(full)


def build_model(cfg_model, *, device="cpu", dtype=torch.float32, seed: int | None = 0) -> Llama:
    """Build a Llama from a conf/model mapping (or a LlamaConfig). On "meta" nothing is initialised:
    call `model.to_empty(device=...)` then `model.init_weights(seed)` later (e.g. after fully_shard)."""
    cfg = cfg_model if isinstance(cfg_model, LlamaConfig) else LlamaConfig.from_mapping(cfg_model)
    model = Llama(cfg, device=device, dtype=dtype)
    if torch.device(device).type != "meta":
        model.init_weights(seed)
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of parameters; shared (tied) tensors count once, DTensors count their global size."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
