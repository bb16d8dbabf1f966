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
``(seed, facility, facility_rank, step)``; eval batches use a separate stream. Every random draw of a batch
is one tensor op; the transitions along a sequence, each depending on the last token, are walked in plain
Python integers (:func:`_walk`: ~0.3 us per token, no tensor op per position).
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


def _walk(cur, row_off, u, cum, succ_flat) -> list[list[int]]:
    """The ``T`` states after ``cur`` ``[B]``, as ``B`` lists of ``T`` ints: transition ``t`` of row ``b`` takes
    the first slot whose cumulative probability exceeds ``u[b, t]`` in chain row ``cur + row_off[b, t]``.

    Each token depends on the one before, so the positions are walked in order, in plain Python integers over
    memoryviews of the tables (no tensor op per position, no copy of the tables): about 0.3 us per token on one
    CPU core, against ~40 us per position for a loop of tensor ops and ``B * T * V * (K + log2 T)`` work for
    prefix compositions of per-position maps. The float32 thresholds read as exact Python floats: the same
    comparisons, the same tokens."""
    k = cum.shape[1]
    thresholds = memoryview(cum.contiguous().numpy()).cast("B").cast("f")
    successors = memoryview(succ_flat.contiguous().numpy()).cast("B").cast("q")
    out = []
    for state, offsets, draws in zip(cur.tolist(), row_off.tolist(), u.reshape(u.shape[0], -1).tolist()):
        row = []
        for offset, x in zip(offsets, draws):
            slot = (state + offset) * k
            while x >= thresholds[slot]:  # the last slot's threshold is 2.0: u < 1 stops there
                slot += 1
            state = successors[slot]
            row.append(state)
        out.append(row)
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
        how the transitions are computed)."""
        cur = torch.multinomial(self._start_prior, batch_size, replacement=True, generator=gen)
        # which chain drives each transition (exactly the shared one when non_iid == 0)
        use_fac = torch.rand(batch_size, length - 1, generator=gen) < self.non_iid
        row_off = use_fac.to(torch.long) * self.vocab_size
        u = torch.rand(batch_size, length - 1, 1, generator=gen)
        steps = torch.tensor(_walk(cur, row_off, u, self._cum, self._succ_flat), dtype=torch.long)
        return torch.cat([cur[:, None], steps.view(batch_size, length - 1)], dim=1)

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
