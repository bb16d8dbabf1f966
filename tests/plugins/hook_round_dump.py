"""``$XFFL_TEST_DUMP_ROUNDS=<dir>``: the values around every aggregation, for the tests to check.

The end-to-end tests must check the *values* a job's aggregation produces, not only that all copies
agree (a job that broadcast facility 0's weights would agree too). With the variable set, every rank
saves its local shard of every parameter right before and right after each round's aggregation, with
where it sits (facility, replica, shard) and the parameter's global shape and placements; the test
reassembles each facility's full tensors and computes the weighted mean itself
(``tests/helpers/round_values.py``).

Rounds of a job: :class:`RoundDump`, an observer of the job's rounds
(:data:`xffl_like.train.observers.OBSERVERS`). One file per rank, round and phase:
``round<R>_<phase>_rank<K>.pt`` (``phase`` is ``before`` or ``after``; also ``init`` once before the
first step, and ``start`` where an overlapped fragment exchange takes its snapshot, numbered by the
round that applies it), a dict of plain values and tensors that ``torch.load(..., weights_only=True)``
reads. With compression, ``after`` also holds this rank's ``message`` (the bytes it sent) and its
error-feedback ``residual`` after the round, so a test can decode what every facility sent.

Rounds at a hub (:class:`xffl_like.federation.elastic.exchange.ElasticFederation`): the leader of each
facility saves, per round it holds a result of (its join included), its parameters ``before`` and
θ_global ``after``, the hub's decision (facilities, healed, round, step, status, rejected, weights),
its tokens and, compressed, the ``message`` it sent (None in a round of fp32 parameters):
``<dir>/<facility>/round-<R>-<time_ns>.pt``
(written whole, then renamed: a reader never sees half a file; ``tests/helpers/hub.py``'s ``rounds``).
With ``federation.delay=1`` the leader also saves, at each boundary where a round landed, its gathered
parameters ``x`` before the rule made them the next upload (and eager's ``θ_f``, ``own``):
``<dir>/<facility>/landing-<time_ns>.pt``.

Only ``os`` and ``pathlib`` at import: ``torch`` and the package are imported when a job uses them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from patch_on_import import after_import

ENV = "XFFL_TEST_DUMP_ROUNDS"


def dump_path(directory: str | Path, round_: int, phase: str, rank: int) -> Path:
    """Where rank ``rank`` records ``phase`` (``before``/``after``) of round ``round_``."""
    return Path(directory) / f"round{round_:03d}_{phase}_rank{rank:03d}.pt"


class RoundDump:
    """Saves this rank's local shards around each aggregation into ``$XFFL_TEST_DUMP_ROUNDS``."""

    def __init__(self, model, state):
        self.directory = Path(os.environ[ENV])
        self.model, self.state = model, state
        self.directory.mkdir(parents=True, exist_ok=True)

    def save(self, round_: int, phase: str, **extra) -> None:
        """Record this rank's local shards (``phase``: ``before`` or ``after`` the aggregation, ``init``, ``start``)
        and ``extra`` (tensors copied to the CPU)."""
        import torch

        from xffl_like.distributed.state import to_local

        with torch.no_grad():
            state, params, shapes, placements = self.state, {}, {}, {}
            for name, param in self.model.named_parameters():
                local = to_local(param)
                params[name] = local.detach().to("cpu", copy=True)
                shapes[name] = list(param.shape)  # a DTensor's shape is the global one
                placements[name] = [repr(p) for p in getattr(param, "placements", ())]
            record = {
                "rank": state.rank,
                "facility": state.facility,
                "replica": state.replica,
                "shard": state.shard,
                "shard_size": state.shard_size,
                "round": round_,
                "phase": phase,
                "params": params,
                "shapes": shapes,
                "placements": placements,
                **{k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in extra.items()},
            }
            torch.save(record, dump_path(self.directory, round_, phase, state.rank))


def _load(path: Path):
    """A whole spooled file of the leader as flat fp32."""
    import numpy as np
    import torch

    return torch.from_numpy(np.fromfile(path, dtype=np.float32))


def _save_leader(name: str, values: dict) -> None:
    """The leader's record of one round at the hub, written whole, then renamed."""
    import torch

    path = Path(os.environ[ENV]) / name
    path.mkdir(parents=True, exist_ok=True)
    final = path / f"round-{values['round']:04d}-{time.time_ns()}.pt"
    torch.save(values, path / f".{final.name}.tmp")
    os.replace(path / f".{final.name}.tmp", final)


def _dump_leader_rounds(exchange) -> None:
    """Wrap the leader's round at the hub (``ElasticFederation._lead``, on the leader's thread): its
    spooled parameters before, then what came back (unless the round was missed or it left)."""
    lead = exchange.ElasticFederation._lead

    def _lead(self, tokens: float, done: int, joining: bool) -> dict:
        f = self.files
        before = _load(f.mine)
        out = lead(self, tokens, done, joining)
        if out["status"] not in ("missed", "left"):
            after = _load(f.mine if out["status"] == "created" else f.theta)
            decided = {k: out[k] for k in ("facilities", "healed", "round", "step", "status", "rejected", "weights")}
            sent = self.codec and not joining and f.message.exists()  # none in a round of fp32 parameters
            message = f.message.read_bytes() if sent else None
            _save_leader(
                self.name,
                {**decided, "tokens": tokens, "before": before, "after": after,
                 "applied": out["status"] == "accepted", "message": message},
            )  # fmt: skip
        return out

    exchange.ElasticFederation._lead = _lead


def _dump_landings(delayed) -> None:
    """Wrap the leader's rule at a boundary (``DelayedElasticFederation._compose``, ``EagerElasticFederation.
    _compose_eager``; federation.delay=1): its gathered parameters ``x`` before the rule made them the next upload
    (``landing-*.pt``, in order)."""

    def save(self) -> None:
        import torch

        path = Path(os.environ[ENV]) / self.name
        path.mkdir(parents=True, exist_ok=True)
        final = path / f"landing-{time.time_ns()}.pt"
        own = getattr(self, "own_theta", None)  # eager: θ_f as the rule finds it
        torch.save({"x": _load(self.files.mine), "own": _load(own) if own else None}, path / f".{final.name}.tmp")
        os.replace(path / f".{final.name}.tmp", final)

    compose = delayed.DelayedElasticFederation._compose
    compose_eager = delayed.EagerElasticFederation._compose_eager

    def _compose(self, theta, start, mine) -> None:
        save(self)
        compose(self, theta, start, mine)

    def _compose_eager(self, landed, stale) -> None:
        save(self)
        compose_eager(self, landed, stale)

    delayed.DelayedElasticFederation._compose = _compose
    delayed.EagerElasticFederation._compose_eager = _compose_eager


def _observe_rounds(observers) -> None:
    observers.OBSERVERS.append(RoundDump)


if os.environ.get(ENV):
    after_import("xffl_like.train.observers", _observe_rounds)
    after_import("xffl_like.federation.elastic.exchange", _dump_leader_rounds)
    after_import("xffl_like.federation.elastic.delayed", _dump_landings)
