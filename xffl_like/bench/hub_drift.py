"""``python -m xffl_like.bench.hub_drift``: how far one attacker drags θ_global under each aggregation rule.

A hub's federation (:class:`~xffl_like.hub.server.federation.HubFederation`, in this process, its uploads
spooled to real files and checked as on the network) of ``--honest`` members and one attacker, for
``--rounds`` rounds. Each round every honest member uploads θ_global minus a random update of norm ``--step``
(a fresh direction each time); the attacker uploads θ_global minus ``--scale`` x ``--step`` along one fixed
unit direction ``u``, every round, just under ``federation.elastic.max_norm_ratio`` (10) so the norm check
accepts it. Each member claims tokens: the attacker all that its geometry allows, the honest ones a quarter,
so ``tokens`` weights give the attacker the most weight. Per rule (``federation.elastic.aggregate``) and
weights rule: the drift of θ_global along the attack over the run, beside the same federation with an honest
member in the attacker's place (the drift honest members make along ``u`` by chance, and the norm of
θ_global's step per round then: the honest step). Prints a table, and ``--json`` writes it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from ..hub.protocol.messages import ArriveRequest, JoinRequest, ResultHeader, ResultRequest, UploadHeader
from ..hub.protocol.wire import Frames, frames_of
from ..hub.server.federation import HubFederation

__all__ = ["drift", "main", "spec_of"]

GEOMETRY = {"batch_size": 2, "seq_len": 8, "dp": 1}  # 32 tokens a step at most
EVERY = 2


def spec_of(numel: int, aggregate: str = "mean", weights: str = "uniform", trim: float = 0.2, ratio: float = 10.0,
            compression: str = "none") -> dict:  # fmt: skip
    """A hub federation's description: one fp32 vector of ``numel`` values, plain averaging outer step."""
    return {
        "parameters": [["w", [numel], "float32"]],
        "algorithm": "federated",
        "outer": {"name": "average", "lr": 1.0, "momentum": 0.0, "betas": [0.9, 0.99], "eps": 1e-8, "offload": False},
        "compression": {"kind": compression, "chunk_size": 4096, "error_feedback": False},
        "every_s": None,
        "rounds": 1000,
        "train.steps": None,
        "weights": "uniform",
        "grace_s": 600.0,
        "max_norm_ratio": ratio,
        "aggregate": aggregate,
        "trim": trim,
        "weights_rule": weights,
        "paced": False,
        "min_facilities": 1,
    }


class Federation:
    """``names`` joined to a fresh in-process hub on ``spec``, the first creating it with ``theta``."""

    def __init__(self, state: Path, spec: dict, names: list[str], theta: torch.Tensor):
        self.fed = HubFederation(state, None, log=lambda _: None)
        self.spec, self.names, self.rounds = spec, names, 0
        for n in names:
            msg = {"spec": spec, "session": n, "geometry": GEOMETRY, "every": EVERY, "steps": 1000 * EVERY}
            self.fed.join(n, JoinRequest.from_json(msg))
            if n == names[0]:
                self.fed.create(n, _frames(UploadHeader(n, "create"), theta))

    def round(self, uploads: dict[str, torch.Tensor], tokens: dict[str, float]) -> ResultHeader:
        """Every member arrives and uploads ``uploads[name]`` (parameters, or the encoded update); the outcome."""
        self.rounds += 1
        step, rid = self.rounds * EVERY, None
        for n in self.names:
            msg = {"session": n, "version": self.fed.version, "step": step, "taken": EVERY, "tokens": tokens[n]}
            reply = self.fed.arrive(n, ArriveRequest.from_json(msg))
            assert reply.action == "upload", reply
            rid = reply.round
        for n in self.names:
            self.fed.upload(n, _frames(UploadHeader(n, "round", round=rid), uploads[n]))
        first = self.names[0]
        reply = self.fed.result(first, ResultRequest(first, rid), lambda: True)
        frames = Frames(reply, lambda header: header.nbytes, ResultHeader)  # θ_global, or a compressed round's relay
        for _ in frames.chunks():
            pass
        return frames.header

    @property
    def theta(self) -> torch.Tensor:
        return self.fed.theta.clone()

    def close(self) -> None:
        self.fed.close()


def _frames(header, values: torch.Tensor) -> Frames:
    """The frames of an upload of ``values`` (fp32 parameters, or a codec's bytes), as the hub receives them."""
    nbytes = values.numel() * values.element_size()
    return Frames(frames_of(header.to_json(), values), nbytes, type(header))


def drift(aggregate: str, weights: str, honest: int = 2, rounds: int = 30, numel: int = 4096, step: float = 1.0,
          scale: float = 9.5, attack: bool = True, trim: float = 0.2, seed: int = 0) -> dict:  # fmt: skip
    """One run: the drift of θ_global along the attack direction, and the honest step's norm."""
    g = torch.Generator().manual_seed(seed)
    theta0 = torch.randn(numel, generator=g)
    u = torch.randn(numel, generator=g)
    u /= u.norm()
    names = [f"h{i}" for i in range(honest)] + ["x"]
    bound = EVERY * GEOMETRY["batch_size"] * GEOMETRY["seq_len"] * GEOMETRY["dp"]
    tokens = {n: bound / 4 for n in names} | {"x": float(bound)}
    spec = spec_of(numel, aggregate, weights, trim)
    with tempfile.TemporaryDirectory() as tmp:
        fed = Federation(Path(tmp) / "state", spec, names, theta0)
        try:
            accepted, moves = 0, 0.0
            for _ in range(rounds):
                theta = fed.theta
                ups = {}
                for n in names:
                    d = torch.randn(numel, generator=g)
                    ups[n] = theta - d * (step / d.norm())
                if attack:
                    ups["x"] = theta - scale * step * u
                accepted += "x" in fed.round(ups, tokens).accepted
                moves += float((fed.theta - theta).norm())
            moved = fed.theta - theta0
        finally:
            fed.close()
    along = float(torch.dot(-moved, u))  # the attacker pushes θ along -u (its update θ_g - θ_f is +u)
    return {"aggregate": aggregate, "weights": weights, "members": honest + 1, "attack": attack,
            "drift": along, "per_round": along / rounds, "attacker_accepted": accepted, "step": step,
            "theta_step": moves / rounds}  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m xffl_like.bench.hub_drift", description=__doc__.split("\n")[0])
    p.add_argument("--honest", type=int, nargs="+", default=[2, 4], help="honest members (one run each)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--numel", type=int, default=4096)
    p.add_argument("--scale", type=float, default=9.5, help="the attacker's update over the honest norm")
    p.add_argument("--trim", type=float, default=0.2, help="federation.elastic.trim for trimmed_mean")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    rows = []
    print(f"{'members':>7} {'weights':>7} {'aggregate':>12} {'drift':>8} {'honest-only':>11} {'honest step':>11} "
          f"{'accepted':>8}")  # fmt: skip
    for honest in a.honest:
        for weights in ("uniform", "tokens"):
            for rule in ("mean", "median", "trimmed_mean"):
                kw = dict(honest=honest, rounds=a.rounds, numel=a.numel, scale=a.scale, trim=a.trim)
                r = drift(rule, weights, **kw)
                calm = drift(rule, weights, attack=False, **kw)
                r["honest_only"], r["honest_step"] = calm["drift"], calm["theta_step"]
                rows.append(r)
                print(f"{r['members']:>7} {weights:>7} {rule:>12} {r['drift']:>8.2f} {r['honest_only']:>11.2f} "
                      f"{r['honest_step']:>11.2f} "
                      f"{r['attacker_accepted']:>5}/{a.rounds}")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
