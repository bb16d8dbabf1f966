"""``federation.delay=1`` through the hub: :class:`DelayedElasticFederation` (``delay_rule=own_full``).

One world's ``own_full`` rule (:mod:`xffl_like.federation.delayed`) keeps one θ_g for everyone, stepped on each
round's mean one round late, and makes each facility's local model ``θ_g - Δ_r``: the landed global model plus
its own progress still in flight, at full weight. The hub already holds that θ_g: its θ_global, stepped by its
outer optimizer on each round's mean. So the hub's rounds stay what they are, and only the facility changes:

- at the boundary ``b_r`` the hub's round ``r - 1``, which ran during round ``r``, lands: θ_global of version
  ``r - 1`` (the hub's, bitwise, or applied here from the relay with compression);
- the round's pseudo-gradient is ``Δ_r = s_r - x_r`` (``s_r``: where round ``r`` started, ``x_r``: the
  facility's model now), and the model becomes ``u_r = θ_global - Δ_r``;
- after the boundary's checkpoint, round ``r``'s exchange starts in a thread of the leader: ``u_r`` goes up to
  the hub's round at step ``b_r`` exactly as a round's parameters do without delay (the hub's pseudo-gradient
  ``θ_global - u_r`` is ``Δ_r``; with compression the message encodes it plus the residual) while round
  ``r + 1`` trains from ``s_{r+1} = u_r``. The leader's thread only uploads, waits and downloads: no
  collective runs outside the training thread, and every rank learns the result at ``b_{r+1}``.

The arithmetic is the leader's, on its spool files a window at a time (``start.f32``: ``u_r``, what went up;
``parameters.f32``: ``x`` gathered, then ``u`` written over it and scattered back): no rank holds a second
copy of the model. Where nothing landed (the first boundary, after a join or a resume, or a round the hub
did not answer) the model stays ``x``: its progress since the last θ_global it holds goes up whole at the next
round. A round in which the hub healed or rejected this facility lands θ_global without its ``Δ_r``: that
round is discarded, as one world's non-finite guard discards one; a realigned step carries over to the steps
trained since. The job's last boundary lands the round in flight, then makes its own round in the foreground
(the federation's final one, :meth:`~xffl_like.hub.client.HubLink.until_final`): every facility ends on the
hub's final θ_global, bitwise.

Checkpoints: one at ``b_r`` is taken after the model became ``u_r`` and before the exchange starts. A
resumed facility rejoins, as every restarted facility does (θ_global and the outer state live at the hub):
it heals to θ_global and the federation's step, and its pending ``Δ_r`` is not sent.
"""

from __future__ import annotations

import os
import time

import torch

from ..record import RoundRecord
from .exchange import _WINDOW, ElasticFederation, _read_into

__all__ = ["DelayedElasticFederation", "own_full_window"]


def own_full_window(theta: torch.Tensor, start: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``θ_global - (s - x)``: the landed θ_global plus the progress still in flight (fp32, in this order)."""
    return theta - (start - local)


class DelayedElasticFederation(ElasticFederation):
    """:class:`~.exchange.ElasticFederation` with ``federation.delay=1`` (``delay_rule=own_full``): the module's
    rule; a round's exchange runs from the boundary's :meth:`start` to the next boundary's :meth:`finish`."""

    rule = "own_full"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.flight: dict | None = None  # the round in flight: the leader's handle, its step, when it started
        self.pending = False  # the model is u: its round is still to start (after the boundary's checkpoint)

    # ------------------------------------------------------------------ the loop's interface
    def finish(self, boundary, index: int) -> list[RoundRecord]:
        """At a boundary: the round in flight lands (the rule); at the job's end this facility's last round
        follows in the foreground."""
        if not boundary.finish:
            return []
        records = self._land(boundary.step)
        if boundary.end:
            self.pending = False
            records.append(self.round_at(records[-1].step if records else boundary.step))
        return records

    def start(self, boundary, index: int) -> None:
        """After the boundary's checkpoint: the exchange of ``u`` starts (the leader's thread)."""
        if self.pending:
            self._launch(boundary.step)

    def leave(self) -> None:
        flight, self.flight = self.flight, None
        if flight is not None and self.leader:  # a stop while a round is in flight: it ends now, unapplied
            if self.link is not None:
                self.link.cancel()
            flight["handle"]["thread"].join(timeout=60.0)
        super().leave()

    def describe(self) -> dict:
        return {**super().describe(), "delay": 1, "delay_rule": self.rule}

    # ------------------------------------------------------------------ the rule
    def _launch(self, done: int) -> None:
        """Round at step ``done``: ``files.mine`` (``u``) goes up in a thread of the leader (collective: the
        round's tokens)."""
        tokens = self._round_tokens()
        self.pending = False

        def work() -> dict:
            out = self._lead(tokens, done, False)
            out["exchange_seconds"] = time.perf_counter() - started
            return out

        started = time.perf_counter()
        self.flight = {"handle": self._spawn(work), "step": done}

    def _land(self, done: int) -> list[RoundRecord]:
        """After ``done`` steps: wait for the round in flight, gather ``x``, and where θ_global came back make
        the model ``θ_global - (s - x)`` (collective). Its record, or none when nothing was in flight."""
        started, flight, self.flight = time.perf_counter(), self.flight, None
        f = self.files if self.leader else None
        out = self._await(flight["handle"]) if flight is not None else None
        if flight is not None and self.leader:
            os.replace(f.mine, f.start)  # what went up: where the round that ends now started
        self._gather(f.mine if self.leader else None)
        self.pending = True
        if flight is None:
            return []

        def take() -> None:
            if self.leader:
                self._compose(f.theta, f.start, f.mine)
            self._scatter(f.mine if self.leader else None)

        record = self._conclude(out, started, take)
        record.step += done - flight["step"]  # a realigned step carries over to the steps trained since
        record.landed = [flight["step"]]
        if self.leader:
            record.exchange_seconds = out.get("exchange_seconds", 0.0)
        return [record]

    def _compose(self, theta, start, mine) -> None:
        """``mine <- θ_global - (start - mine)`` (the leader's files), a window at a time."""
        target = mine.with_name(f"{mine.name}.next")
        with open(theta, "rb") as t, open(start, "rb") as s, open(mine, "rb") as x, open(target, "wb") as out:
            for first in range(0, self.numel, _WINDOW):
                n = min(_WINDOW, self.numel - first)
                read = [_read_into(fh, torch.empty(n, dtype=torch.float32)) for fh in (t, s, x)]
                own_full_window(*read).numpy().tofile(out)
        os.replace(target, mine)
