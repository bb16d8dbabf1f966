"""Synthetic, learnable, non-IID token source (no files).

Tokens follow a sparse first-order Markov chain.  Each facility's chain is a
mixture ``(1 - non_iid) * shared + non_iid * own`` of

* a *shared* chain, seeded by ``seed`` only (identical for every facility), and
* a *facility-specific* chain, seeded by ``(seed, facility)``.

Every chain gives each token ``BRANCH`` successors drawn from a Zipf prior over a
chain-specific permutation of the vocabulary, so both the unigram and the bigram
statistics are skewed (a model learns the unigram part in a few steps and the
bigram part soon after) and differ between facilities when ``non_iid > 0``.
The conditional entropy is at most ``log(2 * BRANCH)`` nats, far below
``log(vocab_size)``.

Sampling is vectorised over the batch with a ``torch.Generator`` seeded by
``(seed, facility, facility_rank, step)``; eval batches use a separate stream. The transitions along a
sequence are walked as prefix compositions of per-position maps (no loop over the positions) where that
is cheaper than a loop over them, else one position at a time: the same tokens either way.
"""

from __future__ import annotations

import math

import torch

from ..config.checks import is_number
from ..config.errors import ConfigError
from ..config.schema import DataConfig
from .source import check_num_eval_batches, check_positive_int, make_generator

__all__ = ["SyntheticMarkovSource", "validate_synthetic", "BRANCH", "ZIPF_EXPONENT"]

BRANCH = 4  # successors per token and chain
ZIPF_EXPONENT = 0.8  # skew of the successor prior over the (permuted) vocabulary
_SLOT_DECAY = 0.7  # successor k gets weight ~ exp(-_SLOT_DECAY * k) (times a random factor)

# stream tags, so that no two uses of the same seed share a random stream
_TAG_SHARED_CHAIN = 0x5348
_TAG_FACILITY_CHAIN = 0x4643
_TAG_TRAIN = 0x5452
_TAG_EVAL = 0x4556


def _check_non_iid(cfg_data: DataConfig) -> float:
    value = cfg_data.non_iid
    ok = is_number(value)
    if ok:
        value = float(value)
        ok = math.isfinite(value) and 0.0 <= value <= 1.0
    if not ok:
        raise ConfigError(f"data.non_iid: must be a number in [0, 1], got {value!r} (pass e.g. data.non_iid=0.5)")
    return value


def validate_synthetic(cfg_data: DataConfig, *, vocab_size: int, seq_len: int) -> None:
    check_positive_int(vocab_size, "vocab_size", "set the model's vocab_size to at least 2")
    if vocab_size < 2:
        raise ConfigError(
            f"vocab_size: must be at least 2 for the synthetic source, got {vocab_size} "
            "(set the model's vocab_size to at least 2)"
        )
    check_positive_int(seq_len, "seq_len", "set a positive sequence length")
    check_num_eval_batches(cfg_data)
    _check_non_iid(cfg_data)


def _make_chain(vocab_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(successors [V, K] long, cumulative probs [V, K] float, start prior [V] float)."""
    v = vocab_size
    perm = torch.randperm(v, generator=gen)
    ranks = torch.arange(1, v + 1, dtype=torch.float64)
    prior = torch.empty(v, dtype=torch.float64)
    prior[perm] = ranks.pow(-ZIPF_EXPONENT)
    prior /= prior.sum()
    succ = torch.multinomial(prior, v * BRANCH, replacement=True, generator=gen).view(v, BRANCH)
    weights = torch.exp(-_SLOT_DECAY * torch.arange(BRANCH, dtype=torch.float64)) * (
        0.5 + torch.rand(v, BRANCH, generator=gen, dtype=torch.float64)
    )
    probs = weights / weights.sum(dim=1, keepdim=True)
    cum = probs.cumsum(dim=1)
    cum[:, -1] = 2.0  # u in [0, 1) never passes the last slot, whatever the rounding
    return succ, cum.to(torch.float32), prior


#: :func:`_walk` costs ~5 ns per table entry and doubling round (``B * T * V * (K + log2 T)``), the loop ~40 us
#: per transition (``T``), on one CPU core: the walk is the cheaper one while ``B * V * (K + log2 T)`` stays
#: below this. Measured: B=8, T=128, V=256 (the main job) 16.7 ms walked, 5.3 ms looped.
VECTORISED_BELOW = 8000


def vectorised_is_cheaper(batch_size: int, transitions: int, vocab_size: int) -> bool:
    """Whether :func:`_walk` (no Python loop over the positions) beats :func:`_walk_loop` for this shape.
    Either gives the same tokens; on CUDA the trainer draws batches on a prefetch thread, so the loop never
    runs on the training thread there (:class:`xffl_like.data.prefetch.Prefetcher`)."""
    rounds = max(transitions - 1, 1).bit_length()
    return transitions > 1 and batch_size * vocab_size * (BRANCH + rounds) < VECTORISED_BELOW


def _walk(cur, row_off, u, cum, succ_flat, vocab_size: int) -> torch.Tensor:
    """The ``T`` states after ``cur`` ``[B]``, ``[B, T]``, with no Python loop over ``T``.

    Transition ``t`` of row ``b`` is a map of the states, ``M[b, t, s]``: the successor of ``s`` chosen by
    ``u[b, t]`` in the chain ``row_off[b, t]`` picks (the comparisons :func:`_walk_loop` makes, for every
    ``s`` at once). The state after ``t + 1`` transitions is ``(M_t o ... o M_0)(cur)``: the prefix
    compositions take ``log2(T)`` doubling rounds (Hillis-Steele). Integer lookups of the same float32
    comparisons: the same tokens as the loop, bit for bit."""
    b, t = row_off.shape
    k = cum.shape[1]
    rows = torch.arange(vocab_size)[None, None, :] + row_off[:, :, None]  # [B, T, V]: each state's row
    slot = (u[:, :, :, None] >= cum[rows]).sum(dim=-1)  # [B, T, V] (u: [B, T, 1] -> [B, T, 1, 1])
    maps = succ_flat[rows * k + slot]  # [B, T, V]: M_t
    shift = 1
    while shift < t:  # maps[:, i] becomes M_i o ... o M_{max(0, i - 2 shift + 1)}
        maps = torch.cat([maps[:, :shift], torch.gather(maps[:, shift:], 2, maps[:, :-shift])], dim=1)
        shift *= 2
    return torch.gather(maps, 2, cur[:, None, None].expand(b, t, 1)).squeeze(2)


def _walk_loop(cur, row_off, u, cum, succ_flat) -> torch.Tensor:
    """:func:`_walk` one transition at a time (a Python loop over ``T``)."""
    k = cum.shape[1]
    out = torch.empty(row_off.shape, dtype=torch.long)
    for t in range(row_off.shape[1]):
        row = cur + row_off[:, t]
        slot = (u[:, t] >= cum.index_select(0, row)).sum(dim=1)
        cur = succ_flat.index_select(0, row * k + slot)
        out[:, t] = cur
    return out


class SyntheticMarkovSource:
    """Facility ``facility``'s Markov-chain token stream, rank ``facility_rank``'s share of it."""

    def __init__(
        self,
        *,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        seed: int,
        facility: int,
        facility_rank: int,
        non_iid: float,
        num_eval_batches: int,
    ) -> None:
        self.vocab_size = int(vocab_size)
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.facility = int(facility)
        self.facility_rank = int(facility_rank)
        self.non_iid = float(non_iid)
        self.num_eval_batches = int(num_eval_batches)

        s_succ, s_cum, s_prior = _make_chain(self.vocab_size, make_generator(self.seed, _TAG_SHARED_CHAIN))
        f_succ, f_cum, f_prior = _make_chain(
            self.vocab_size, make_generator(self.seed, _TAG_FACILITY_CHAIN, self.facility)
        )
        # rows 0..V-1: shared chain, rows V..2V-1: facility chain
        self._succ_flat = torch.cat([s_succ, f_succ]).reshape(-1).contiguous()
        self._cum = torch.cat([s_cum, f_cum]).contiguous()
        a = self.non_iid
        start = (1.0 - a) * s_prior + a * f_prior
        self._start_prior = (start / start.sum()).to(torch.float32)
        self._eval_cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    # ------------------------------------------------------------------ sampling
    def _sample(self, gen: torch.Generator, batch_size: int, length: int) -> torch.Tensor:
        """``[batch_size, length]`` tokens: the chain's start, then ``length - 1`` transitions, each drawn with
        one uniform ``u`` and one chain choice per position (drawn up front, so the tokens do not depend on
        how the transitions are computed: :func:`_walk` vectorised, or :func:`_walk_loop`)."""
        cur = torch.multinomial(self._start_prior, batch_size, replacement=True, generator=gen)
        # which chain drives each transition (exactly the shared one when non_iid == 0)
        use_fac = torch.rand(batch_size, length - 1, generator=gen) < self.non_iid
        row_off = use_fac.to(torch.long) * self.vocab_size
        u = torch.rand(batch_size, length - 1, 1, generator=gen)
        if vectorised_is_cheaper(batch_size, length - 1, self.vocab_size):
            steps = _walk(cur, row_off, u, self._cum, self._succ_flat, self.vocab_size)
        else:
            steps = _walk_loop(cur, row_off, u, self._cum, self._succ_flat)
        return torch.cat([cur[:, None], steps], dim=1)

    def _batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self._sample(gen, self.batch_size, self.seq_len + 1)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = make_generator(self.seed, _TAG_TRAIN, self.facility, self.facility_rank, int(step))
        return self._batch(gen)

    def eval_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._eval_cache is None:
            self._eval_cache = [
                self._batch(make_generator(self.seed, _TAG_EVAL, self.facility, self.facility_rank, i))
                for i in range(self.num_eval_batches)
            ]
        return [(x.clone(), y.clone()) for x, y in self._eval_cache]

    def transition_matrix(self) -> torch.Tensor:
        """Exact next-token distribution ``P[cur, next]`` of this facility ([V, V], float64)."""
        v, k = self.vocab_size, BRANCH
        cum = self._cum.to(torch.float64).clone()
        cum[:, -1] = 1.0
        probs = torch.diff(cum, dim=1, prepend=torch.zeros(2 * v, 1, dtype=torch.float64))
        succ = self._succ_flat.view(2 * v, k)
        mats = torch.zeros(2, v, v, dtype=torch.float64)
        for c in range(2):
            mats[c].scatter_add_(1, succ[c * v : (c + 1) * v], probs[c * v : (c + 1) * v])
        return (1.0 - self.non_iid) * mats[0] + self.non_iid * mats[1]

    def __repr__(self) -> str:
        return (
            f"SyntheticMarkovSource(vocab_size={self.vocab_size}, seq_len={self.seq_len}, "
            f"batch_size={self.batch_size}, facility={self.facility}, rank={self.facility_rank}, "
            f"non_iid={self.non_iid})"
        )


def build_synthetic(
    cfg_data: DataConfig,
    *,
    vocab_size: int,
    seq_len: int,
    batch_size: int,
    seed: int,
    facility: int,
    facility_rank: int,
) -> SyntheticMarkovSource:
    """Facility ``facility``'s source, from a config :func:`validate_synthetic` accepted in the launcher."""
    return SyntheticMarkovSource(
        vocab_size=vocab_size,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        facility=facility,
        facility_rank=facility_rank,
        non_iid=cfg_data.non_iid,
        num_eval_batches=cfg_data.num_eval_batches,
    )
