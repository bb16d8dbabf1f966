"""Top-k with low-bit values and SparseLoCo's error feedback (``federation.compression=topk``).

SparseLoCo (Sarfi et al., arXiv 2508.15706; its public code ``src/tplr/sparseloco.py``) replaces DiLoCo's global
outer momentum by a local error-feedback accumulator per facility and sends only the largest entries of it:

    e <- decay * e + u          (u = theta_global - theta_f, this round's update; decay = beta)
    m  = C(e)                   (per 64 x 64 tile the top-k entries by magnitude, in 4 bins per tensor)
    e <- e - decode(m)          (what was not sent stays for later rounds)
    theta_global <- theta_global - outer.lr * mean_senders(decode(m_f))

``mean_senders`` is, per index, the mean over the facilities that sent it (SparseLoCo's ``scatter_reduce(mean,
include_self=False)``; with weights, ``sum w_f v_f / sum w_f`` over those facilities: :class:`TopkFold`). The
accumulator plays the outer momentum's part, so the paper's outer rule is plain SGD at lr 1
(``federation.outer.name=average``, the federation's default); another outer rule still runs on that mean.

The message's codec, its tiles (or flat chunks), bins (or levels) and bytes: :mod:`.topk_tensors`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..distributed.compat import all_gather_single

__all__ = ["BITS", "TopkFold", "TopkMean", "fold_weights", "zero_code_shares"]

BITS = (2, 4, 8)


def fold_weights(weights: list[float]) -> list[float]:
    """The weights :class:`TopkFold` takes: as given, except equal weights, where every facility weighs 1 (the same
    mean, computed as SparseLoCo does: the sum over the senders over their count)."""
    if len({w for w in weights if w != 0}) == 1:
        return [1.0 if w != 0 else 0.0 for w in weights]
    return list(weights)


class TopkFold:
    """The mean over facilities of their top-k messages, one facility at a time: the one fold of the one-world
    exchange, the hub and the facilities' relay. Per index, the weighted mean over the facilities that sent it,
    ``sum_f w_f v_f / sum_f w_f`` over those ``f``; with equal weights ``w_f = 1`` (:func:`fold_weights`) it is
    ``(v_1 + ... + v_m) / m`` in facility order, as SparseLoCo's ``scatter_reduce(mean, include_self=False)``; an
    index nobody sent stays 0. Each product ``w_f v_f`` is rounded, then added (two roundings, as numpy computes
    it; never a fused multiply-add, whose rounding would depend on the CPU), and the division runs only where a
    value was sent. ``out`` (flat fp32, zeroed by the caller) receives the mean; a facility of weight 0 is left
    out."""

    def __init__(self, out: Tensor):
        self.out = out
        self.den = torch.zeros_like(out)
        self.sent: list[Tensor] = []

    @torch.no_grad()
    def add(self, index: Tensor, values: Tensor, weight: float) -> None:
        """Fold one facility's sent ``values`` at the flat ``index`` (unique), of weight ``weight``."""
        if weight == 0:
            return
        self.out.index_add_(0, index, values * weight)
        self.den.index_add_(0, index, torch.full_like(values, weight))
        self.sent.append(index)

    @torch.no_grad()
    def finish(self) -> Tensor:
        """The mean (``out``). An index two facilities sent is divided twice, from the same sums into the same
        value."""
        if self.sent:
            index = torch.cat(self.sent) if len(self.sent) > 1 else self.sent[0]
            self.out.index_put_((index,), self.out[index] / self.den[index])
            self.sent = []
        return self.out


class TopkMean:
    """The mean over ``n`` peers of their top-k messages (``codec``: :class:`.topk_tensors.TensorCodec`), with
    SparseLoCo's error feedback of decay ``decay``.

    The exchange (one world): every peer all-gathers the others' fixed-size messages and decodes them all, folding
    them (:class:`TopkFold`) in peer order, so every facility holds the same fp32 mean. ``residual`` is the
    error-feedback accumulator ``e`` (checkpointed by the federation).
    """

    def __init__(self, codec, n: int, decay: float, device: torch.device | str = "cpu"):
        self.codec, self.numel, self.n, self.decay = codec, codec.numel, n, float(decay)
        self.residual = torch.zeros(self.numel, dtype=torch.float32, device=device)
        #: Per message this rank encoded, in order: ``(kept values sent as a zero code, kept values)``.
        self.zero_codes: list[tuple[int, int]] = []

    @torch.no_grad()
    def prepare(self, update: Tensor) -> Tensor:
        """``e <- decay * e + update``; encode ``e``; ``e <- e - decoded``. Returns the message (flat uint8).
        Every copy of a facility may call it (same bytes and accumulator)."""
        acc = self.residual.mul_(self.decay).add_(update)
        message = self.codec.encode(acc)
        index, values = self.codec.decode_sparse(message)
        acc.index_put_((index,), acc[index] - values)
        self.zero_codes.append((int(values.numel() - torch.count_nonzero(values)), int(values.numel())))
        return message

    @torch.no_grad()
    def reduce(self, message: Tensor, group, me: int, scales: list[float]) -> tuple[Tensor, int]:
        """All-gather ``message`` among the peers of ``group`` (this peer is number ``me``) and return the
        :class:`TopkFold` of the decoded messages, peer ``j`` of weight ``scales[j]`` (flat fp32, identical on
        every peer) and the bytes this rank sent. A peer of weight 0 is left out."""
        if self.n == 1:
            gathered = message.view(1, -1)
        else:
            gathered = torch.empty(self.n * message.numel(), dtype=torch.uint8, device=message.device)
            all_gather_single(gathered, message.contiguous(), group=group)
            gathered = gathered.view(self.n, -1)
        fold = TopkFold(torch.zeros(self.numel, dtype=torch.float32, device=message.device))
        weights = fold_weights(scales)
        for j in range(self.n):
            if weights[j] != 0:
                fold.add(*self.codec.decode_sparse(gathered[j]), weights[j])
        return fold.finish(), (self.n - 1) * message.nbytes


def zero_code_shares(counts: list[tuple[int, int]], state) -> list[list[float | None]]:
    """Per message (in the order this job encoded them) and per facility, the share of the kept values that
    were sent as a zero code (a slot that carries nothing), over every rank's shard of the facility's message.
    ``counts``: this rank's :attr:`TopkMean.zero_codes`; collective over the world (every rank encodes the same
    number of messages). A facility that sent no value has None."""
    import torch.distributed as dist

    table = torch.zeros(len(counts), state.num_facilities, 2, dtype=torch.float64, device=state.device)
    if counts:
        table[:, state.facility] = torch.tensor(counts, dtype=torch.float64, device=state.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table)
    return [[None if kept == 0 else zeros / kept for zeros, kept in row] for row in table.tolist()]
