"""A round among the facilities present: :class:`ElasticFederation`.

Facilities differ in size and sharding, so the exchange is between their leaders (rank 0 of
each facility's own world) on full, flat fp32 vectors of the parameters:

1. every rank of the facility takes part in gathering the full parameters onto the leader;
2. the leader asks the Lighthouse for the round's quorum (:class:`.coordinator.Coordinator`)
   and opens the quorum's process group;
3. **heal**: members whose round counter is behind the most advanced (a facility that joins late,
   restarts, or missed a round's commit) receive the federation's state from the first
   up-to-date member: θ_global, the outer optimizer's state and the round and step counters;
   they take part in this round with weight 0;
4. the weighted mean of the others' parameters (``uniform`` or ``tokens``: trained since their
   last round) by all-reduce, or, with ``compression``, the mean of their compressed updates
   ``θ_global - θ_f`` (each facility's message all-gathered, decoded and summed in name order;
   its error-feedback residual kept by its leader);
5. **commit**: one more all-reduce that only completes when every member has the whole result.
   Nothing above touched the state; only now θ_global moves (the mean, or an outer step on
   ``θ_global - mean``), and the leader broadcasts it to its facility, where each rank copies
   its own shard. A member lost anywhere before (its process killed, its link cut: an error or
   ``timeout_s``) drops the round everywhere and the leaders ask for a new quorum among those
   left, with the same parameters. A commit seen by some and not others shows in the next
   quorum as a round counter behind, which step 3 heals.

θ_global, the outer state and the residual live on the leader only, in host memory (full fp32
vectors: the leader needs them whole for the exchange). A facility's checkpoint keeps its
model, inner optimizer, data position and round counter; the federation's state comes from a
live facility when it rejoins (or is its own model when it is alone).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from ...distributed.signals import requested
from ...distributed.state import to_local
from ..clock import round_clock
from ..compress import CompressedMean
from ..options import rounds_description
from ..outer import OuterOptimizer
from ..protocol import RoundClock

__all__ = ["ElasticFederation"]

_DUMP = "XFFL_TEST_DUMP_ROUNDS"  # tests: each round's values on the leader, beside the records


def _work(op) -> None:
    op.wait()


def _test_pause(round_index: int) -> None:
    """Tests ($XFFL_TEST_ELASTIC_PAUSE=ROUND:FILE): this leader stops between the exchange and the commit
    of round ROUND, writes FILE and waits there 120 s (for the test to kill its facility mid-round)."""
    spec = os.environ.get("XFFL_TEST_ELASTIC_PAUSE")
    if spec and int(spec.split(":", 1)[0]) == round_index:
        Path(spec.split(":", 1)[1]).write_text(str(os.getpid()))
        time.sleep(120)


def _test_hold(round_index: int) -> None:
    """Tests: ``$XFFL_TEST_ELASTIC_ASKING=FILE``: write FILE when first asking for a quorum;
    ``$XFFL_TEST_ELASTIC_HOLD=ROUND:FILE``: before asking for round ROUND's, wait (up to 300 s) for FILE
    (another facility asking: a facility that is late for that round, deterministically)."""
    asking = os.environ.get("XFFL_TEST_ELASTIC_ASKING")
    if asking:
        Path(asking).write_text(str(os.getpid()))
    spec = os.environ.get("XFFL_TEST_ELASTIC_HOLD")
    if spec and int(spec.split(":", 1)[0]) == round_index:
        deadline = time.time() + 300
        while not Path(spec.split(":", 1)[1]).exists() and time.time() < deadline:
            time.sleep(0.1)


def _roles(info: list[dict]) -> tuple[int, list[int], list[int]]:
    """From the members' data: the donor (the first up-to-date member that does not join), the members
    behind (to heal: an older round, or joining), the members at a boundary (the others)."""
    latest = max(int(d.get("round", 0)) for d in info)
    ready = [i for i, d in enumerate(info) if int(d.get("round", 0)) == latest]
    donor = next((i for i in ready if not info[i].get("joining")), ready[0])
    behind = [i for i, d in enumerate(info) if i != donor and (int(d.get("round", 0)) < latest or d.get("joining"))]
    at_boundary = [i for i, d in enumerate(info) if not d.get("joining") and i not in behind]
    return donor, behind, at_boundary


class ElasticFederation:
    """This rank's side of the rounds among facilities (collective over the facility's world); the
    training side's :class:`~..protocol.Rounds`, plus :meth:`join` and :meth:`leave`."""

    def __init__(self, cfg, model: torch.nn.Module, state, name: str, steps: int, link=None):
        """``steps``: this facility's steps in the job; ``link``: with ``federation.elastic.hub``, the
        leader's :class:`~.hub_link.HubLink` (the hub holds the federation; None elsewhere)."""
        self.options, self.state, self.name, self.steps = cfg, state, name, steps
        self.model = model
        self.params = list(model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.leader = state.rank == 0
        self.round = 0  # rounds the federation has completed (adopted from a live facility)
        self.tokens = 0.0  # tokens this rank trained since its facility's last round
        self.records: list[dict] = []  # per round this facility took part in: members, healed, attempts
        self.ended = False  # federation.every_s: the last round made ended the job
        self.last_step = 0  # this facility's steps at its last round (or join)
        self.coordinator = None
        self.link = link
        self.theta: Tensor | None = None
        self.outer: OuterOptimizer | None = None
        self.compressor: CompressedMean | None = None
        # Where this facility's rounds end: every `every` of its steps, or by its own step time (every_s).
        self.clock: RoundClock = round_clock(cfg, state, steps, ended=lambda: self.ended)
        full = self._gather()
        self.ef: Tensor | None = None  # hub with compression: θ_global + this facility's residual
        if self.leader and link is not None:
            self.theta = full  # the one flat copy: uploaded, then overwritten by θ_global
            if cfg.compression != "none":
                from ..update_codec import UpdateCodec

                self.codec = UpdateCodec(cfg.compression, self.numel, cfg.chunk_size)
        elif self.leader:
            from .coordinator import Coordinator

            self.coordinator = Coordinator(cfg.elastic, name)
            self.theta = full
            self.outer = OuterOptimizer(cfg.outer, self.theta)
            if cfg.compression != "none":
                self.compressor = CompressedMean(cfg.compression, self.numel, 1, cfg.chunk_size, cfg.error_feedback)

    # ------------------------------------------------------------------ inside the facility
    @torch.no_grad()
    def _gather(self) -> Tensor | None:
        """The full parameters, flat fp32 in host memory, on the leader (collective)."""
        out = torch.empty(self.numel, dtype=torch.float32) if self.leader else None
        offset = 0
        for p in self.params:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if out is not None:
                out[offset : offset + p.numel()].copy_(full.reshape(-1))
            offset += p.numel()
        return out

    @torch.no_grad()
    def _scatter(self, flat: Tensor | None) -> None:
        """Set every rank's shards to the leader's full ``flat`` (collective)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        offset = 0
        for p in self.params:
            buf = torch.empty(p.shape, dtype=torch.float32, device=self.state.device)
            if flat is not None:
                buf.copy_(flat[offset : offset + p.numel()].view(p.shape))
            dist.broadcast(buf, src=0)
            if isinstance(p, DTensor):  # this rank's piece, cut locally (no communication)
                buf = distribute_tensor(buf, p.device_mesh, p.placements, src_data_rank=None).to_local()
            to_local(p).detach().copy_(buf)
            offset += p.numel()

    def _while_leader_works(self, work):
        """Run ``work()`` on the leader while the other ranks wait on a small broadcast every second
        (so a long wait for other facilities never trips this facility's collective timeout);
        returns the leader's result (None elsewhere). Collective."""
        result: dict = {}
        if self.leader:

            def run():
                try:
                    result["value"] = work()
                except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                    result["error"] = exc

            thread = threading.Thread(target=run, daemon=True, name="xffl-elastic-round")
            thread.start()
        flag = torch.zeros(1, dtype=torch.int32, device=self.state.device)
        while True:
            if self.leader:
                thread.join(timeout=1.0)
                if self.link is not None and thread.is_alive() and requested() is not None:
                    self.link.cancel()  # a stop while waiting in a round: leave now, not after the round
                flag.fill_(0 if thread.is_alive() else (2 if "error" in result else 1))
            dist.broadcast(flag, src=0)
            if int(flag.item()) != 0:
                break
        if int(flag.item()) == 2:
            if self.leader:
                raise result["error"]
            from .options import ElasticError

            raise ElasticError(f"facility {self.name}: its leader left the federation (see rank 0's line)")
        return result.get("value")

    # ------------------------------------------------------------------ the loop's interface (protocol.Rounds)
    def trained(self, tokens: int) -> None:
        self.tokens += tokens

    def after_backward(self) -> int:
        """A local step was taken (its backward passes are done); nothing crosses facilities here."""
        self.clock.step_taken()
        return 0

    def applies_at(self, done: int) -> bool:
        """A round after ``done`` steps: at each of the clock's boundaries."""
        return self.clock.due(done)

    def finish_due(self, done: int, index: int) -> list[dict]:
        """The round after ``done`` steps (its record); the clock's next round begins."""
        record = self.round_at(done)
        self.clock.round_done(done)
        return [record]

    def starts_at(self, done: int) -> bool:
        return False  # no exchange overlaps local steps

    def start_due(self, done: int, index: int) -> None:
        pass

    def join(self, step: int) -> int:
        """Before training: take part in the federation's next round as a member to heal (weight 0),
        or start it when none is live. Returns the step to train from (the federation's)."""
        return self._round(step, joining=True)["step"]

    def round_at(self, done: int) -> dict:
        """The round after ``done`` local steps; its record."""
        return self._round(done, joining=False)

    def leave(self) -> None:
        if self.coordinator is not None:
            self.coordinator.leave()
        if self.link is not None and self.leader:
            self.link.leave()

    def _round(self, done: int, joining: bool) -> dict:
        start = time.perf_counter()
        full = self._gather()
        tokens = torch.tensor([self.tokens], dtype=torch.float64, device=self.state.device)
        dist.all_reduce(tokens)
        self.tokens = 0.0
        out = self._while_leader_works(lambda: self._lead(full, float(tokens.item()), done, joining))
        header = torch.zeros(5, dtype=torch.float64, device=self.state.device)
        if self.leader:
            header.copy_(
                torch.tensor([out["round"], out["step"], float(out["changed"]), out["bytes"], float(out["ended"])])
            )
        dist.broadcast(header, src=0)
        before = self.round
        self.round, step, changed, sent = int(header[0]), int(header[1]), bool(header[2]), int(header[3])
        self.ended = bool(header[4])
        self.last_step = step
        if changed:
            self._scatter(self.theta if self.leader else None)
        # The index of the round committed here; None for a join that only healed (no mean yet).
        record = {
            "round": self.round - 1 if self.round > before else None,
            "step": step,
            "fragment": None,
            "seconds": time.perf_counter() - start,
            "bytes_per_rank": sent if self.leader else 0,
            "cross_facility_bytes": sent,
            "skipped_facilities": [],
        }
        if self.leader:
            record.update({k: out[k] for k in ("facilities", "healed", "attempts", "status", "reason", "rejected")
                           if k in out})  # fmt: skip
            self.records.append(record)
        return record

    # ------------------------------------------------------------------ the leader's round
    def _lead(self, mine: Tensor, tokens: float, done: int, joining: bool) -> dict:
        if self.link is not None:
            return self._lead_hub(mine, tokens, done, joining)
        attempts, cfg = 0, self.options
        _test_hold(self.round)
        while True:
            attempts += 1
            data = {
                "round": self.round,
                "step": done,
                "tokens": tokens,
                "joining": joining,
                "taken": done - self.last_step,
                "every": cfg.every,
                "steps": self.steps,
            }
            quorum = self.coordinator.quorum(self.round, data)
            names = [m.replica_id for m in quorum.participants]
            if joining and len(names) < cfg.elastic.min_facilities:
                time.sleep(0.5)  # not enough facilities yet: ask again
                continue
            try:
                out = self._exchange(quorum, names, mine, tokens, joining, done)
            except (RuntimeError, OSError) as exc:  # a member lost: drop the round, ask again
                print(
                    f"facility {self.name}: round {self.round} with {', '.join(names)} dropped "
                    f"({str(exc).splitlines()[0][:100]}); asking the lighthouse again",
                    flush=True,
                )
                continue
            out.update(attempts=attempts, facilities=names)
            return out

    def _lead_hub(self, mine: Tensor, tokens: float, done: int, joining: bool) -> dict:
        """Through the hub: ``mine`` is uploaded, then holds θ_global (the hub's, bitwise)."""
        before = mine.clone() if os.environ.get(_DUMP) else None
        if joining:
            out = self.link.join(mine, done, self.options.elastic.min_facilities)
            if self.options.compression != "none":
                self.ef = mine.clone()  # θ_global, no residual yet
        elif self.ef is not None:
            out = self._round_compressed(mine, done, tokens)
        else:
            out = self.link.round(mine, done, tokens, taken=done - self.last_step)
        self.theta = mine
        if before is not None and out["status"] not in ("missed", "joined", "created"):
            self._dump({**{k: out[k] for k in ("facilities", "healed", "round", "step", "status", "rejected")},
                        "weights": out["weights"], "tokens": tokens, "before": before, "after": mine.clone(),
                        "applied": out["status"] == "accepted"})  # fmt: skip
        return out

    def _round_compressed(self, mine: Tensor, done: int, tokens: float) -> dict:
        """Upload the encoded update ``θ_global + residual - θ_f``; keep the new residual only when the hub
        accepted it (a rejected or healed facility starts again from θ_global, without residual)."""
        message = self.codec.encode(torch.sub(self.ef, mine))
        kept = {}

        def on_status(header: dict) -> None:
            kept["status"] = header["status"]
            if header["status"] == "accepted" and self.options.error_feedback:
                self.ef.sub_(mine).sub_(self.codec.decode(message))  # the residual, until θ_global is added

        out = self.link.round(mine, done, tokens, taken=done - self.last_step, message=message, on_status=on_status)
        if kept.get("status") == "accepted" and self.options.error_feedback:
            self.ef.add_(mine)
        elif "status" in kept:
            self.ef.copy_(mine)
        if out["status"] == "accepted":
            out["bytes"] = message.numel() + 4 * self.numel
        return out

    def _exchange(self, quorum, names: list[str], mine: Tensor, tokens: float, joining: bool, done: int) -> dict:
        cfg, me, n = self.options, names.index(self.name), len(names)
        info = [dict(m.data or {}) for m in quorum.participants]
        donor, behind, at_boundary = _roles(info)
        pg = self.coordinator.group(quorum, me) if n > 1 else None
        # 3. heal: the donor's state to a scratch copy (applied only after the commit)
        counters, theta, buffers, sent = self._heal(pg, info, donor, behind, me)
        # 4. the weighted mean over the members at a boundary (the healed ones weigh 0)
        weights = self._weights(info, at_boundary)
        target, residual, bytes_out = self._mean(pg, me, theta, mine, weights)
        sent += bytes_out
        _test_pause(self.round)
        # 5. commit: completes only if every member got here
        if pg is not None:
            _work(pg.allreduce([torch.ones(1)]))
        rounds = self._commit(counters, theta, buffers, target, residual)
        step = self._own_step(info[donor], done) if joining or me in behind else done
        # federation.every_s: the job ends after the first round in which a member reached train.steps.
        ended = cfg.every_s is not None and max(int(d.get("step", 0)) for d in info) >= self.steps
        self._dump(
            {
                "facilities": names,
                "weights": weights,
                "healed": [names[i] for i in behind],
                "round": rounds,
                "step": step,
                "before": mine,
                "after": self.theta.clone(),
                "applied": target is not None,
            }
        )
        changed = target is not None or me in behind or joining
        return {
            "round": rounds,
            "step": step,
            "changed": changed,
            "bytes": sent,
            "ended": ended,
            "healed": [names[i] for i in behind],
        }

    def _heal(self, pg, info: list[dict], donor: int, behind: list[int], me: int):
        """The donor's round, step and outer steps, θ_global and the outer buffers: this member's own
        (scratch copies for a member behind), and the bytes this member sent."""
        theta, buffers, sent = self.theta, dict(self.outer.buffers), 0
        counters = torch.tensor(
            [float(self.round), float(info[donor]["step"]), float(self.outer.steps)], dtype=torch.float64
        )  # the donor's round, step and outer steps
        if behind:
            healed = [counters.clone(), self.theta.clone(), *(b.clone() for b in buffers.values())]
            for t in healed:
                _work(pg.broadcast(t, donor))
                sent += t.nbytes if me == donor else 0
            if me in behind:
                counters, theta = healed[0], healed[1]
                buffers = dict(zip(buffers, healed[2:]))
        return counters, theta, buffers, sent

    def _weights(self, info: list[dict], at_boundary: list[int]) -> list[float]:
        """Each member's weight in the mean (0 for the healed ones). ``weights=null``: tokens when the members
        took different steps since their last round (each facility its own federation.every, or every_s), else
        uniform."""
        cfg = self.options
        mode = cfg.weights
        if mode is None:
            mode = "tokens" if cfg.paced or len({info[i].get("taken") for i in at_boundary}) > 1 else "uniform"
        return [
            (float(info[i]["tokens"]) if mode == "tokens" else 1.0) if i in at_boundary else 0.0
            for i in range(len(info))
        ]

    def _mean(self, pg, me: int, theta: Tensor, mine: Tensor, weights: list[float]):
        """The round's target (None when no member weighs), the new residual, the bytes this member sent."""
        n, total = len(weights), sum(weights)
        if total <= 0:
            return None, None, 0
        if self.compressor is not None:
            return self._compressed_mean(pg, n, theta, mine, weights, total, contributes=weights[me] > 0)
        target = mine * (weights[me] / total)
        if pg is None:
            return target, None, 0
        _work(pg.allreduce([target]))
        return target, None, 2 * (n - 1) * target.nbytes // n

    def _commit(self, counters: Tensor, theta: Tensor, buffers: dict, target, residual) -> int:
        """After the commit: adopt the (healed) state, move θ_global to the target; the rounds made."""
        cfg = self.options
        self.theta = theta
        self.outer.theta = theta
        self.outer.buffers.update(buffers)
        self.outer.steps = int(counters[2])
        rounds = int(counters[0])
        if residual is not None:
            self.compressor.residual = residual
        if target is not None:
            if self.compressor is None and cfg.outer.is_plain_mean:
                self.theta.copy_(target)
            else:
                delta = target if self.compressor is not None else torch.sub(self.theta, target)
                self.outer.step(delta)
            rounds += 1
        return rounds

    def _own_step(self, theirs: dict, done: int) -> int:
        """The step a joiner (or a member that missed a commit) trains from: its own with every_s; else the
        federation's rounds x its own federation.every (the donor's step when every is shared)."""
        cfg = self.options
        if cfg.every_s is not None:
            return done
        if int(theirs["step"]) >= int(theirs.get("steps", self.steps)):
            return self.steps  # the federation's last step
        # as many of its own rounds as the donor's steps are of the donor's
        return min(int(theirs["step"]) // int(theirs.get("every") or cfg.every) * cfg.every, self.steps)

    def _compressed_mean(
        self, pg, n: int, theta: Tensor, mine: Tensor, weights: list[float], total: float, contributes: bool
    ):
        """The weighted mean of the members' compressed updates ``θ_global - θ_f``; the new residual (a member
        that heals this round sends zeros and keeps its residual: its update is not part of the mean)."""
        comp = self.compressor
        kept = comp.residual
        comp.residual = None if kept is None or not contributes else kept.clone()
        update = torch.sub(theta, mine) if contributes else torch.zeros_like(mine)
        try:
            message = comp.prepare(update)  # adds the residual, stores the new one in comp.residual
            new_residual = comp.residual if contributes else kept
        finally:
            comp.residual = kept  # applied only after the commit
        gathered = [torch.empty_like(message) for _ in range(n)]
        if pg is not None:
            _work(pg.allgather([gathered], [message]))
        else:
            gathered[0].copy_(message)
        mean = torch.zeros(self.numel, dtype=torch.float32)
        for j, row in enumerate(gathered):
            if weights[j]:
                mean.add_(comp.decode(row).view(-1)[: self.numel], alpha=weights[j] / total)
        return mean, new_residual, (n - 1) * message.nbytes

    def _dump(self, values: dict) -> None:
        """Tests ($XFFL_TEST_DUMP_ROUNDS): the leader's parameters before and θ_global after each committed round."""
        where = os.environ.get(_DUMP)
        if where:
            path = Path(where) / self.name
            path.mkdir(parents=True, exist_ok=True)
            torch.save(values, path / f"round-{values['round']:04d}-{time.time_ns()}.pt")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The round counter (the federation's state itself comes from a live facility on rejoin)."""
        return {"rounds": torch.tensor(self.round), "tokens": torch.tensor([self.tokens], dtype=torch.float64)}

    def load_state_dict(self, sd: dict) -> None:
        self.round = int(sd["rounds"])

    def describe(self) -> dict:
        o = self.options
        return {
            **rounds_description(o),
            "elastic": {
                "facility": self.name,
                "lighthouse": o.elastic.lighthouse,
                "hub": o.elastic.hub,
                "rounds": [
                    {
                        k: r[k]
                        for k in (
                            "round",
                            "step",
                            "seconds",
                            "facilities",
                            "healed",
                            "attempts",
                            "status",
                            "reason",
                            "rejected",
                        )
                        if k in r
                    }  # fmt: skip
                    for r in self.records
                ],
            },
        }
