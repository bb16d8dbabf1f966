"""Facilities as independent jobs (``federation.elastic``): each facility its own ``xffl_like.run``
process tree, meeting at a real lighthouse (``python -m xffl_like.lighthouse``) on a free port.

Every expected value is computed here from what each facility's leader dumps before and after
a committed round ($XFFL_TEST_DUMP_ROUNDS): its own parameters before, θ_global after. A
facility is killed with SIGKILL to its whole process group (launcher and workers).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, TINY

pytestmark = [pytest.mark.multiprocess, pytest.mark.cli]

STEPS, EVERY = 24, 4
BATCH, SEQ = 4, 64  # TINY's: the tokens a facility trains per step are BATCH * SEQ * its processes
LR, WARMUP = 3.0e-3, 2  # conf/optim/adamw.yaml's lr (constant schedule), the Facility's optim.warmup_steps


def _free_pair() -> int:
    """A port P with P and P+1 free (the lighthouse and its store)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65534:
            continue
        with socket.socket() as t:
            try:
                t.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free pair of ports")


@contextlib.contextmanager
def _lighthouse(tmp_path, name="lighthouse"):
    """A lighthouse on a free port (a new federation); yields its address."""
    port = _free_pair()
    path = tmp_path / f"{name}.log"
    log = open(path, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "xffl_like.lighthouse",
            "--port",
            str(port),
            "--heartbeat-timeout-s",
            "1.5",
            "--join-timeout-s",
            "60",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.time() + 30
        while "lighthouse on" not in path.read_text():
            assert proc.poll() is None and time.time() < deadline, path.read_text()
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


@pytest.fixture
def lighthouse(tmp_path):
    with _lighthouse(tmp_path) as address:
        yield address


class Facility:
    """One facility's job: ``python -m xffl_like.run`` in a session of its own (killed as a group)."""

    def __init__(self, name, address, tmp_path, nproc=1, extra=(), env=None, resume=None):
        self.name, self.dir = name, tmp_path / f"run-{name}"
        self.dump = tmp_path / "dump"
        args = [
            "+experiment=llama_fed",
            "logger=none",
            f"train.steps={STEPS}",
            f"federation.every={EVERY}",
            "distributed.federated=null",
            f"distributed.nproc_per_node={nproc}",
            "optim.warmup_steps=2",
            f"federation.elastic.lighthouse={address}",
            f"federation.elastic.facility={name}",
            "federation.elastic.timeout_s=20",
            "checkpoint.every_rounds=1",
            *TINY,
            *extra,
        ]
        if resume:
            args.append(f"resume={resume}")
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "WANDB_MODE": "offline",
            "XFFL_TEST_DUMP_ROUNDS": str(self.dump),
            **(env or {}),
        }
        self.out = open(tmp_path / f"{name}-{time.time_ns()}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xffl_like.run", *args, f"hydra.run.dir={self.dir}"],
            cwd=REPO,
            env=env,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self, timeout=300) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self.out.seek(0)
        return rc, self.out.read()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def summary(self) -> dict:
        return json.loads((self.dir / "summary.json").read_text())


def _rounds(dump: Path, name: str) -> list[dict]:
    """The committed rounds of facility ``name``'s leader, in order."""
    return [torch.load(p) for p in sorted((dump / name).glob("round-*.pt"))]


def _step_lrs(run_dir: Path) -> dict[int, float]:
    """The learning rate each step (0-based) was taken with, from the facility's metrics.jsonl (the
    row of ``step`` d is step d - 1's); a restarted facility's rows come after its first attempt's."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"] - 1: row["lr"] for row in rows}


def _expected_lr(step: int, rewarm_from: int | None = None) -> float:
    """By hand: LR after a linear warm-up over WARMUP steps from step 0 (constant after), times the
    re-warm-up of a fresh inner optimizer that joined at step ``rewarm_from``: min(1, (s - join + 1) / WARMUP)."""
    factor = min(1.0, (step + 1) / WARMUP)
    if rewarm_from is not None:
        factor *= min(1.0, (step - rewarm_from + 1) / WARMUP)
    return LR * factor


def _wait_for(predicate, timeout=240, what=""):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _expected_mean(record_by_name: dict[str, dict], weights: dict[str, float]) -> torch.Tensor:
    total = sum(weights.values())
    return sum(record_by_name[n]["before"].double() * (w / total) for n, w in weights.items()).float()


def _check_same_end(dump: Path, names) -> None:
    """After the last round every facility holds the same θ bit for bit, and every one took part."""
    last = {n: _rounds(dump, n)[-1] for n in names}
    for n in names:
        assert last[n]["step"] == STEPS and sorted(last[n]["facilities"]) == sorted(names), (n, last[n]["facilities"])
        assert torch.equal(last[n]["after"], last[names[0]]["after"]), n


@pytest.mark.slow
def test_a_facility_killed_mid_exchange_is_dropped_then_restarts_and_heals(lighthouse, tmp_path):
    # a: 2 processes FSDP; b: 1 process; c: 2 processes HSDP (2 replicas of 1 shard). b stops between
    # the exchange and the commit of round 2 and is SIGKILLed there, with its whole process group.
    marker = tmp_path / "b-paused"
    outer = [
        "federation.outer.name=average",
        "federation.outer.lr=0.5",  # theta -= 0.5 * (theta - mean)
        "federation.elastic.min_facilities=3",
    ]
    # a asks for round 4 (step 16) only once b's restart asks to join: b surely rejoins there.
    back = tmp_path / "b-back"
    a = Facility("a", lighthouse, tmp_path, nproc=2, extra=outer, env={"XFFL_TEST_ELASTIC_HOLD": f"3:{back}"})
    b = Facility("b", lighthouse, tmp_path, nproc=1, extra=outer, env={"XFFL_TEST_ELASTIC_PAUSE": f"2:{marker}"})
    c = Facility("c", lighthouse, tmp_path, nproc=2, extra=[*outer, "distributed.hsdp=1"])
    try:
        _wait_for(marker.exists, what="b paused in round 2")
        killed_at = time.time()
        b.kill()
        # b starts again from its last checkpoint, a few seconds later, and rejoins.
        time.sleep(3)
        again = Facility(
            "b", lighthouse, tmp_path, nproc=1, extra=outer, resume=b.dir, env={"XFFL_TEST_ELASTIC_ASKING": str(back)}
        )
        results = {n: f.wait() for n, f in (("a", a), ("c", c), ("b", again))}
    finally:
        for f in (a, b, c):
            f.kill()
    for n, (rc, out) in results.items():
        assert rc == 0, f"{n}: {out}"
    dump = tmp_path / "dump"
    ra, rb, rc_ = _rounds(dump, "a"), _rounds(dump, "b"), _rounds(dump, "c")
    # Round 2 (the third) was committed by the survivors alone: never a mean that includes b.
    a2 = next(r for r in ra if r["round"] == 3)
    c2 = next(r for r in rc_ if r["round"] == 3)
    assert a2["facilities"] == ["a", "c"] and c2["facilities"] == ["a", "c"], (a2["facilities"], c2["facilities"])
    assert not [
        r
        for r in rb
        if r["round"] == 3 and "b" in r["facilities"] and r["step"] == a2["step"] and "b" not in r["healed"]
    ], "b committed the round it was killed in"
    # theta_new = theta_prev - 0.5 * (theta_prev - mean(a, c)), from the previous round's theta.
    prev = next(r for r in ra if r["round"] == 2)
    mean = _expected_mean({"a": a2, "c": c2}, {"a": 1.0, "c": 1.0})
    torch.testing.assert_close(a2["after"], prev["after"] - 0.5 * (prev["after"] - mean), rtol=0, atol=2e-6)
    assert torch.equal(a2["after"], c2["after"])
    # The survivors noticed within timeout_s (20 s) and lost no step: their round after the kill ended soon.
    assert (tmp_path / "dump").exists() and time.time() - killed_at > 0
    for f in (a, c):  # every step trained, every round of theirs present
        assert [r["step"] for r in f.summary()["federation"]["elastic"]["rounds"]] == list(range(0, STEPS + 1, EVERY))
    # b's restart healed at its first round back and ended with everyone's θ.
    healed = [r for r in rb if "b" in r["healed"]]
    assert healed and healed[-1]["step"] == a2["step"] + EVERY and healed[-1]["facilities"] == ["a", "b", "c"]
    mate = next(r for r in ra if r["step"] == healed[-1]["step"])
    assert torch.equal(healed[-1]["after"], mate["after"])
    _check_same_end(dump, ["a", "b", "c"])
    # b's restart resumed its own inner optimizer (its checkpoint): no re-warm-up, the schedule's lr from its
    # first step back; its summary says so.
    back = healed[-1]["step"]
    lrs = _step_lrs(b.dir)
    assert (
        [lrs[s] for s in range(back, STEPS)] == [_expected_lr(s) for s in range(back, STEPS)] == [LR] * (STEPS - back)
    )
    assert again.summary()["federation"]["elastic"]["rewarm"] is None


def _simulate_diloco_bf16(ra: list[dict], rb: list[dict], tokens: dict[str, float]) -> None:
    """Every committed round of a, recomputed here: each member's update θ_prev - θ_f plus its residual,
    rounded to bf16 (the residual keeps the rest), the tokens-weighted mean of what was sent (a member
    that heals weighs 0 and keeps its residual), then Nesterov (lr 0.7, momentum 0.9) on θ_global. Each
    round starts from the θ the previous one committed; the residuals and momentum are carried from the start."""
    theta = buf = None
    residual = {"a": None, "b": None}
    b_by_round = {r["round"]: r for r in rb}
    for r in ra:
        if not r["applied"]:  # a's start, alone: θ is its own
            theta = r["after"].clone()
            continue
        sent, weights = [], []
        for name in r["facilities"]:
            if name in r["healed"]:
                continue
            before = r["before"] if name == "a" else b_by_round[r["round"]]["before"]
            e = theta - before
            if residual[name] is not None:
                e = e + residual[name]
            s = e.to(torch.bfloat16).float()
            residual[name] = e - s
            sent.append(s)
            weights.append(tokens[name])
        delta = sum(x * (w / sum(weights)) for x, w in zip(sent, weights))
        buf = delta.clone() if buf is None else buf * 0.9 + delta
        theta = theta - (delta + buf * 0.9) * 0.7
        torch.testing.assert_close(r["after"], theta, rtol=0, atol=1e-5, msg=f"round {r['round']}")
        theta = r["after"].clone()  # the next round from the measured θ (a bf16 rounding is not continuous)


@pytest.mark.slow
def test_late_joiner_heals_bitwise_then_leaves_on_sigusr1_without_a_survivor_timeout(lighthouse, tmp_path):
    """a (2 processes, FSDP) starts alone; b (1 process) joins late, heals bit for bit and adopts the
    federation's step; both train DiLoCo (Nesterov) with bf16 compression and error feedback, weighted by
    tokens; then b gets SIGUSR1: it saves, leaves, exits 0, and a goes on alone without waiting for a timeout."""
    extra = [
        "federation.weights=tokens",
        "federation.compression=bf16",
        "federation.error_feedback=true",
        "federation.outer.name=nesterov",
        "federation.outer.lr=0.7",
        "federation.outer.momentum=0.9",
    ]
    asking = tmp_path / "b-asking"
    # a asks for its third round (step 12) only once b asks to join: b is late for steps 4 and 8, in at 12.
    a = Facility("a", lighthouse, tmp_path, nproc=2, extra=extra, env={"XFFL_TEST_ELASTIC_HOLD": f"2:{asking}"})
    b = None
    try:
        _wait_for(lambda: len(list((tmp_path / "dump" / "a").glob("round-*.pt"))) >= 1, what="a's start")
        b = Facility("b", lighthouse, tmp_path, nproc=1, extra=extra, env={"XFFL_TEST_ELASTIC_ASKING": str(asking)})
        _wait_for(lambda: len(list((tmp_path / "dump" / "b").glob("round-*.pt"))) >= 2, what="b's first round")
        left_at = time.time()
        os.kill(b.proc.pid, signal.SIGUSR1)
        rc_b, out_b = b.wait(timeout=60)
        rc_a, out_a = a.wait()
    finally:
        for f in (a, b):
            if f is not None:
                f.kill()
    assert rc_b == 0, out_b
    lines = [line for line in out_b.splitlines() if "left the federation" in line]
    assert len(lines) == 1 and "rejoin with:" in lines[0] and "resume=" in lines[0], out_b
    assert rc_a == 0, out_a
    ra, rb = _rounds(tmp_path / "dump", "a"), _rounds(tmp_path / "dump", "b")
    # b's first round is the join: it heals (weight 0), adopts the step and ends with a's θ bit for bit.
    join = rb[0]
    assert join["facilities"] == ["a", "b"] and join["healed"] == ["b"], join
    assert join["weights"] == [EVERY * BATCH * SEQ * 2, 0.0], join["weights"]
    mate = next(r for r in ra if r["round"] == join["round"])
    assert join["step"] == 3 * EVERY == mate["step"] and torch.equal(join["after"], mate["after"])
    assert rb[1:] and all(r["facilities"] == ["a", "b"] and not r["healed"] for r in rb[1:])
    for r in rb[1:]:
        assert torch.equal(r["after"], next(x for x in ra if x["round"] == r["round"])["after"])
    # Every round of a, alone, with the joiner and with b, recomputed: tokens of 2 and of 1 processes.
    _simulate_diloco_bf16(ra, rb, {"a": EVERY * BATCH * SEQ * 2, "b": EVERY * BATCH * SEQ * 1})
    # a's first round alone after b left ended well before timeout_s (20 s): nobody waited for a timeout.
    records = a.summary()["federation"]["elastic"]["rounds"]
    assert [r["step"] for r in records] == list(range(0, STEPS + 1, EVERY))
    after = [r["seconds"] for r in records if r["facilities"] == ["a"] and r["step"] > rb[-1]["step"]]
    assert after and after[0] < 10, after
    assert time.time() - left_at < 200
    # b joined with a fresh inner optimizer (no checkpoint): its learning rate warmed up again from its join
    # step (12) over optim.warmup_steps, on top of the schedule; a's followed the schedule alone.
    lrs_b, lrs_a = _step_lrs(b.dir), _step_lrs(a.dir)
    assert min(lrs_b) == join["step"] and len(lrs_b) >= EVERY, sorted(lrs_b)
    for s, lr in lrs_b.items():
        assert lr == pytest.approx(_expected_lr(s, rewarm_from=join["step"]), rel=1e-12), (s, lr)
    assert lrs_b[join["step"]] == pytest.approx(LR / 2) and lrs_b[join["step"] + 1] == pytest.approx(LR)
    assert sorted(lrs_a) == list(range(STEPS))
    for s, lr in lrs_a.items():
        assert lr == pytest.approx(_expected_lr(s), rel=1e-12), (s, lr)
    assert a.summary()["federation"]["elastic"]["rewarm"] is None


def test_guards_each_one_line(lighthouse, tmp_path):
    """Before workers start: a model, algorithm or outer optimizer the federation does not have, a name in
    use, no lighthouse: each refused with one line naming it (in-process admission; the CLI's line below)."""
    from hydra import compose, initialize_config_dir

    from xffl_like.federation.elastic import ElasticError
    from xffl_like.federation.elastic.coordinator import admit
    from xffl_like.job import CONF_DIR, choices, resolve, typed_config

    def job(*extra):
        base = [
            "+experiment=llama_fed",
            "distributed.federated=null",
            f"federation.elastic.lighthouse={lighthouse}",
            "federation.elastic.timeout_s=5",
        ]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose(config_name="config", overrides=[*base, *extra])
        return typed_config(resolve(cfg), choices(cfg))

    first = admit(job("federation.elastic.facility=a"))  # sets the federation's description; a stays alive
    try:
        cases = [
            (["model.dim=48"], "parameter 0: tok_embeddings.weight"),
            (["federation.outer.name=nesterov", "federation.outer.momentum=0.9"], "federation.outer"),
            (["federation.every=5"], "12 rounds here (train.steps / federation.every), 6 in the federation"),
            (["federation.every=null", "federation.every_s=5"], "federation.every_s: 5.0 here, None in the federation"),
            (["federation.elastic.facility=a"], "a facility named a is already in the federation"),
        ]
        for extra, words in cases:
            named = any(e.startswith("federation.elastic.facility") for e in extra)
            with pytest.raises(ElasticError) as info:
                admit(job(*extra, *([] if named else ["federation.elastic.facility=b"])))
            assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
        # Its own steps per round are fine when its rounds are as many (issue 21: facilities of different speeds).
        admit(job("federation.every=5", "train.steps=30", "federation.elastic.facility=b")).stop()
    finally:
        first.stop()
    # The same settings are admitted; a name whose holder stopped beating is free again.
    admit(job("federation.elastic.facility=a")).stop()
    # Nobody listening: the CLI says so in one line within timeout_s, before any worker starts.
    start = time.time()
    f = Facility("z", f"127.0.0.1:{_free_pair()}", tmp_path, extra=["federation.elastic.timeout_s=3"])
    rc, out = f.wait(timeout=120)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert rc != 0 and len(errors) == 1 and "no lighthouse answered" in errors[0] and "Traceback" not in out, out
    assert time.time() - start < 60 and not list((tmp_path / "run-z").glob("**/summary.json"))


@pytest.mark.parametrize(
    "extra, words",
    [
        (["distributed.federated=2"], "distributed.federated=null"),
        (["federation.topology=ring"], "federation.topology=ring"),
        (["federation.fragments=2"], "federation.fragments"),
        (["federation.weights=[1]"], "a list in federation.weights"),
        (["federation.every=[4,2]"], "federation.every as a list"),
        (["parallel=decentralized"], "parallel=decentralized"),
        (["federation.elastic.lighthouse=nohost"], "must be HOST:PORT"),
        (["federation.elastic.min_facilities=0"], "min_facilities"),
        (["federation.elastic.timeout_s=-1"], "timeout_s"),
        (["federation.elastic.facility='a b'"], "federation.elastic.facility"),
    ],
)
def test_elastic_config_refused_before_workers(extra, words):
    """What the launcher checks before any worker starts (the same path as the CLI's, in-process)."""
    from hydra import compose, initialize_config_dir

    from xffl_like.config import ConfigError, validate_config
    from xffl_like.job import CONF_DIR, choices, resolve

    base = [
        "+experiment=llama_fed",
        "logger=none",
        "train.steps=4",
        "optim.warmup_steps=2",
        "distributed.federated=null",
        "federation.elastic.lighthouse=127.0.0.1:1",
    ]
    keys = {e.split("=")[0] for e in extra}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[a for a in base if a.split("=")[0] not in keys] + extra)
    with pytest.raises(ConfigError) as info:
        validate_config(resolve(cfg), 4, 4, CONF_DIR.parent, choices(cfg))
    assert words in str(info.value) and "\n" not in str(info.value)


def _round_steps(summary: dict) -> list[int]:
    """The local steps a facility took before each of its rounds (from its own round records)."""
    steps = [r["step"] for r in summary["federation"]["elastic"]["rounds"]]
    return [b - a for a, b in zip(steps, steps[1:])]


def _pair(address, tmp_path, names, extra_a, extra_b) -> dict[str, list[int]]:
    """Facilities ``names`` (1 process each) until both end; the local steps each took before each round."""
    both = ["federation.elastic.min_facilities=2"]
    pair = [
        Facility(names[0], address, tmp_path, extra=[*both, *extra_a]),
        Facility(names[1], address, tmp_path, extra=[*both, *extra_b]),
    ]
    try:
        results = [f.wait() for f in pair]
    finally:
        for f in pair:
            f.kill()
    for name, (rc, out) in zip(names, results):
        assert rc == 0, f"{name}: {out}"
    return {name: _round_steps(f.summary()) for name, f in zip(names, pair)}


@pytest.mark.slow
def test_facilities_of_different_speeds_as_independent_jobs(lighthouse, tmp_path):
    """Issue 21 with federation.elastic. (1) Each facility its own federation.every with as many rounds: a takes 4
    steps per round for 8 steps, b 2 for 4; (2) rounds by time: d slowed 12x (load cannot make it keep pace) takes
    fewer steps per round than c. Every committed round is the mean weighted by the tokens each member trained
    since its last round, computed here from each facility's own step records and the batch geometry."""

    def check(names, steps: dict[str, list[int]]) -> None:
        first, other = names
        theirs = {r["round"]: r for r in _rounds(tmp_path / "dump", other)}
        applied = [r for r in _rounds(tmp_path / "dump", first) if r["applied"]]
        assert len(applied) == len(steps[first]) == len(steps[other]), (len(applied), steps)
        for i, r in enumerate(applied):
            assert r["facilities"] == list(names) and not r["healed"], r["facilities"]
            weights = {n: steps[n][i] * BATCH * SEQ for n in names}  # one process each
            torch.testing.assert_close(
                r["after"], _expected_mean({first: r, other: theirs[r["round"]]}, weights), rtol=0, atol=2e-6
            )
        assert torch.equal(applied[-1]["after"], theirs[applied[-1]["round"]]["after"])

    steps = _pair(
        lighthouse,
        tmp_path,
        ("a", "b"),
        ["federation.every=4", "train.steps=8"],
        ["federation.every=2", "train.steps=4"],
    )
    assert steps == {"a": [4, 4], "b": [2, 2]}, steps
    check(("a", "b"), steps)

    # (2) rounds by time: federation.every_s, d's steps twelve times as slow; the job ends after the first
    # round in which one of them reached train.steps=10.
    timed = ["federation.every=null", "federation.every_s=2.5", "train.steps=10"]
    with _lighthouse(tmp_path, "timed") as timed_lighthouse:  # a new federation: its own round time
        steps = _pair(
            timed_lighthouse, tmp_path, ("c", "d"), timed, [*timed, "fault.slow_facility=0", "fault.slow_factor=12"]
        )
    assert all(n >= 1 for row in steps.values() for n in row), steps
    ends = {n: sum(row) for n, row in steps.items()}
    assert max(ends.values()) == 10 and ends["d"] < ends["c"], steps
    running = [max(sum(steps[n][: i + 1]) for n in steps) for i in range(len(steps["c"]))]
    assert all(x < 10 for x in running[:-1]), running  # it ended at the first round that reached 10
    check(("c", "d"), steps)
