"""Training knobs (issue 7): schedules, decay groups, SGD, chunked loss, activation checkpointing,
gradient accumulation under FSDP2/HSDP, eval points, typed train/optim config, unknown keys,
the GPU launch's CPU-visible logic (backend strings, timeout, exchange on nccl, event timers)."""

from __future__ import annotations

import math
from dataclasses import FrozenInstanceError, asdict

import pytest
import torch
import torch.nn.functional as F
from workers import train as train_workers
from workers.train import MODEL, rank_sequences

from xffl_like.aggregation import check_collective
from xffl_like.config.schema import DataConfig, JobConfig, check_keys, job_config
from xffl_like.config.validate import ConfigError, compose_error, validate_config
from xffl_like.distributed.state import group_backend, resolve_backend
from xffl_like.job import CONF_DIR, choices, resolve
from xffl_like.models import LlamaConfig, build_model
from xffl_like.observe.timing import PhaseTimer
from xffl_like.train.evaluate import eval_points
from xffl_like.train.optim import OptimConfig, build_optimizer, build_scheduler, decay_groups
from xffl_like.train.step import TrainConfig

ADAMW = {"name": "adamw", "lr": 0.1, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}


# ----------------------------------------------------------------------------- schedules
def expected_lr(s: int, kind: str, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """The documented schedule, written out again: warm-up (s+1)/w, then decay reaching min_lr at the last step."""
    if s < warmup:
        return lr * (s + 1) / warmup
    if kind == "constant":
        return lr
    p = min(1.0, (s - warmup) / max(1, total - warmup - 1))
    if kind == "linear":
        return lr + (min_lr - lr) * p
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * p)) / 2


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup, total", [(0, 10), (3, 10), (4, 5), (2, 2)])
def test_schedule_matches_formula(kind, warmup, total):
    cfg = OptimConfig.from_mapping({**ADAMW, "schedule": kind, "warmup_steps": warmup, "min_lr": 0.01})
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, total)
    seen = []
    for _ in range(total):
        seen.append([g["lr"] for g in optimizer.param_groups])  # the lr the coming step uses
        optimizer.step()
        scheduler.step()
    for s, lrs in enumerate(seen):
        assert lrs == pytest.approx([expected_lr(s, kind, 0.1, 0.01, warmup, total)] * len(lrs)), (s, lrs)
    if kind != "constant" and total - warmup >= 2:  # the first step after warm-up at lr, the last at min_lr
        assert seen[warmup][0] == pytest.approx(0.1) and seen[-1][0] == pytest.approx(0.01)
    # The scheduler's state is plain data: it survives a state_dict round trip.
    fresh = build_scheduler(build_optimizer(model, cfg), cfg, total)
    fresh.load_state_dict(scheduler.state_dict())
    assert fresh.last_epoch == scheduler.last_epoch and fresh.lr_lambdas[0].__dict__ == scheduler.lr_lambdas[0].__dict__


# ----------------------------------------------------------------------------- decay groups, sgd
@pytest.mark.parametrize("tied", [False, True])
def test_decay_groups_by_name(tied):
    model = build_model(LlamaConfig.from_mapping({**MODEL, "tie_embeddings": tied}), seed=0)
    no_decay = {"tok_embeddings.weight", "norm.weight"} | {
        f"layers.{i}.{n}.weight" for i in range(MODEL["n_layers"]) for n in ("attention_norm", "ffn_norm")
    }
    every = {n for n, _ in model.named_parameters()}
    decay, exempt = decay_groups(model)
    assert set(exempt) == no_decay and set(decay) == every - no_decay
    assert ("output.weight" in decay) != tied  # an untied head is a projection: decayed
    assert decay_groups(model, decay_all=True) == (list(every_in_order(model)), [])

    optimizer = build_optimizer(model, OptimConfig.from_mapping(ADAMW))
    names = {id(p): n for n, p in model.named_parameters()}
    assert [({names[id(p)] for p in g["params"]}, g["weight_decay"]) for g in optimizer.param_groups] == [
        (every - no_decay, 0.01),
        (no_decay, 0.0),
    ]
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["betas"] == (0.9, 0.95)


def every_in_order(model):
    return [n for n, _ in model.named_parameters()]


def test_bias_is_not_decayed_and_sgd_is_sgd():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))
    assert decay_groups(model) == (["0.weight", "2.weight"], ["0.bias", "1.weight", "1.bias"])
    cfg = OptimConfig.from_mapping({"name": "sgd", "lr": 0.5, "momentum": 0.9, "weight_decay": 0.1})
    optimizer = build_optimizer(model, cfg)
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["momentum"] == 0.9
    # One SGD step by hand: no momentum buffer yet, so p - lr * (g + wd * p) on decayed weights only.
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    model(x).square().sum().backward()
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    optimizer.step()
    for n, p in model.named_parameters():
        w, g = before[n]
        wd = 0.1 if n in ("0.weight", "2.weight") else 0.0
        torch.testing.assert_close(p.detach(), w - 0.5 * (g + wd * w))


# ----------------------------------------------------------------------------- chunked loss, checkpointing
def reference_grads(model, inputs, targets):
    """Unchunked: the whole logits tensor, fp32 cross-entropy, as the test computes it."""
    model.zero_grad()
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 100])
def test_chunked_loss_equals_unchunked(tied, chunk):
    model = build_model(LlamaConfig.from_mapping({**MODEL, "tie_embeddings": tied}), seed=1)
    inputs, targets = rank_sequences(0, 3)
    want_loss, want = reference_grads(model, inputs, targets)
    widest = []
    if not tied:  # the head's output never spans more than one chunk of positions
        model.output.register_forward_hook(lambda m, i, o: widest.append(o.shape[1]))
    for ac in (False, True):
        model.zero_grad()
        loss = model(inputs, targets, loss_chunk=chunk, checkpoint_layers=ac)
        loss.backward()
        torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-6, atol=1e-6)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7, msg=f"{n} chunk={chunk} ac={ac}")
    if not tied:
        assert max(widest) == min(chunk, inputs.shape[1])
    with torch.no_grad():  # evaluation takes the same path without autograd
        torch.testing.assert_close(model(inputs, targets, loss_chunk=chunk), want_loss, rtol=1e-6, atol=1e-6)


def test_chunks_and_checkpointing_keep_less_for_backward():
    """Bytes autograd keeps for backward (outside recomputed regions), counted by a saved-tensor hook."""
    model = build_model(LlamaConfig.from_mapping({**MODEL, "vocab_size": 512}), seed=0)
    inputs, targets = rank_sequences(0, 3)
    logits_fp32 = inputs.numel() * 512 * 4

    def kept(**kw):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(inputs, targets, **kw)
        loss.backward()
        return total[0]

    whole, chunked = kept(), kept(loss_chunk=4)
    assert whole - chunked >= logits_fp32  # the whole fp32 logits are no longer kept
    both = kept(loss_chunk=4, checkpoint_layers=True)
    assert both < chunked / 4 and both < logits_fp32  # the blocks keep only their inputs


# ----------------------------------------------------------------------------- grad accumulation under FSDP2
CASES = [(2, 2, "none", 1024), (1, 4, "none", 1024), (4, 1, "full", 5)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_grad_accum_checkpointing_and_chunks_under_hsdp_match_one_big_batch():
    """4 processes = one facility, HSDP 2 replicas x 2 shards. Every case must give the gradient of
    the mean loss over all 16 sequences, computed here on one unsharded model."""
    from xffl_like.distributed.launch import launch_local

    reports = launch_local(train_workers.grad_accum_cases, (None, 2, CASES, 123), 4)
    model = build_model(LlamaConfig.from_mapping(MODEL), seed=3)
    seqs = [rank_sequences(r, 4) for r in range(4)]
    inputs, targets = torch.cat([s[0] for s in seqs]), torch.cat([s[1] for s in seqs])
    _, want = reference_grads(model, inputs, targets)
    with torch.no_grad():
        own = [float(F.cross_entropy(model(x).flatten(0, 1), y.flatten())) for x, y in seqs]
    reference_opt = torch.optim.AdamW(
        [
            {
                "params": [p for n, p in model.named_parameters() if "norm" not in n and "tok_emb" not in n],
                "weight_decay": 0.1,
            },
            {"params": [p for n, p in model.named_parameters() if "norm" in n or "tok_emb" in n], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-4,
    )  # eps: see the workers
    reference_opt.step()
    for r, report in enumerate(reports):
        assert report["timeout_s"] == 123 and report["backend"] == "gloo"  # distributed.timeout_s applied after init
        for (accum, batch, _ac, _chunk), case in zip(CASES, report["cases"]):
            assert case["early_grad"] is False, (r, accum)  # no reduction before the last micro-batch
            assert case["loss"] == pytest.approx(own[r], rel=1e-5)  # this rank's mean over its micro-batches
            for n, p in model.named_parameters():
                torch.testing.assert_close(case["grads"][n], want[n], rtol=1e-4, atol=1e-6, msg=f"{n} {accum}x{batch}")
                torch.testing.assert_close(
                    case["params"][n], p.detach(), rtol=1e-5, atol=1e-6, msg=f"{n} {accum}x{batch}"
                )


@pytest.mark.multiprocess
def test_rope_tables_stay_fp32_in_a_bf16_model():
    """fully_shard casts a module's floating inputs to the compute dtype: the blocks must not, or
    the cos/sin tables reach the attention in bf16."""
    from xffl_like.distributed.launch import launch_local

    seen = launch_local(train_workers.rope_dtypes, ("bfloat16",), 1)[0]
    assert seen == [("torch.bfloat16", "torch.float32", "torch.float32")]


# ----------------------------------------------------------------------------- eval points
def test_eval_points():
    rounds = {4, 8, 10}  # every=4 over 10 steps: rounds after 4, 8 and the last step
    assert [d for d in range(1, 11) if eval_points(d, d in rounds, 3)] == [3, 4, 6, 8, 9, 10]
    assert [d for d in range(1, 11) if eval_points(d, d in rounds, 0)] == [4, 8, 10]


# ----------------------------------------------------------------------------- typed config
@pytest.mark.parametrize(
    "section, override, needle",
    [
        ("optim", {"schedule": "step"}, "optim.schedule='step'"),
        ("optim", {"min_lr": 0.5}, "optim.min_lr=0.5 exceeds optim.lr=0.1"),
        ("optim", {"warmup_steps": None}, "optim.warmup_steps=None"),
        ("optim", {"warmup_steps": 1.5}, "optim.warmup_steps=1.5"),
        ("optim", {"betas": [0.9]}, "optim.betas=[0.9]"),
        ("optim", {"betas": [0.9, 1.0]}, "optim.betas=[0.9, 1.0]"),
        ("optim", {"name": "adam"}, "optim.name='adam'"),
        ("optim", {"lr": 0}, "optim.lr=0"),
        ("optim", {"decay_all": "yes"}, "optim.decay_all='yes'"),
        ("optim", {"weight_decay": None}, "optim.weight_decay=None"),
        ("train", {"grad_accum": 0}, "train.grad_accum=0"),
        ("train", {"activation_checkpointing": "foo"}, "train.activation_checkpointing='foo'"),
        ("train", {"loss_chunk": 0}, "train.loss_chunk=0"),
        ("train", {"eval_every": -1}, "train.eval_every=-1"),
        ("train", {"dtype": "float16"}, "train.dtype='float16'"),
        ("train", {"batch_size": True}, "train.batch_size=True"),
    ],
)
def test_typed_config_rejects(section, override, needle):
    base = {"optim": ADAMW, "train": {"steps": 3, "batch_size": 2, "seq_len": 8}}[section]
    cls = {"optim": OptimConfig, "train": TrainConfig}[section]
    with pytest.raises(ValueError) as err:
        cls.from_mapping({**base, **override})
    assert needle in str(err.value) and "\n" not in str(err.value)


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize(
    "overrides",
    [
        ["+experiment=llama_fed"],
        ["+experiment=llama_fed", "optim=sgd"],
        ["data=text", "logger=none", "model=llama3_1_8b"],
        ["+experiment=llama_hf"],
    ],
)
def test_schema_accepts_every_shipped_composition(overrides):
    cfg = compose(overrides)
    plain = resolve(cfg)
    check_keys(plain, choices(cfg))
    job = job_config(plain)
    assert isinstance(job, JobConfig) and isinstance(job.optim, OptimConfig) and isinstance(job.train, TrainConfig)
    # Every section holds exactly the composed values; validation normalises optim (betas a tuple of floats).
    assert asdict(job) == plain


def one_line_error(overrides):
    """What the launcher reports for ``overrides``: compose (the schema), then validate; one line or None."""
    try:
        cfg = compose(["+experiment=llama_fed", *overrides])
    except Exception as exc:  # noqa: BLE001 - Hydra's and OmegaConf's errors, as the CLI turns them
        return compose_error(exc)
    try:
        validate_config(resolve(cfg), 4, 4, CONF_DIR.parent, choices(cfg))
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["+no_such_key=1"], "no_such_key is not a config key of the root config"),
        (["+optim.foo=1"], "optim.foo is not a config key of optim=adamw"),
        (["+train.deep.key=1"], "train.deep is not a config key of train=default"),
        (["++logger.colour=red"], "logger.colour is not a config key of logger=wandb"),
        (["+federation.outer.foo=1"], "federation.outer.foo is not a config key of federation=default"),
        (["train.nonsense=1"], "train.nonsense is not a config key of train"),
        (
            ["optim.warmup_steps=null"],
            "optim.warmup_steps=None: must be an integer, not null (e.g. optim.warmup_steps=0)",
        ),
        (["optim.betas=[0.9]"], "optim.betas=[0.9]: must be two numbers in [0, 1)"),
        (["optim.betas=0.9"], "optim.betas=0.9: must be a list of numbers"),
        (
            ["logger.mode=onlin"],
            "logger.mode='onlin': use null ($WANDB_MODE, else offline), offline, online or disabled",
        ),
        (["logger=none", "logger.mode=onlin"], "logger.mode='onlin'"),  # every section's keys are checked, used or not
        (["data=text", "data.non_iid=3"], "data.non_iid: must be a number in [0, 1], got 3.0"),
        (["optim.name=adam"], "optim.name='adam': use one of adamw, sgd"),
        (["train.dtype=fp8"], "train.dtype='fp8': use one of auto, float32, bfloat16"),
        (["federation.outer.lr=fast"], "federation.outer.lr='fast': must be a number (e.g. federation.outer.lr=1.0)"),
        (["federation.outer.offload=maybe"], "federation.outer.offload='maybe': must be true or false"),
        (
            ["federation.outer.betas=[a,b]"],
            "federation.outer.betas[0]='a': federation.outer.betas must be a list of numbers",
        ),
        (["federation.outer=3"], "federation.outer=3: must be a mapping of federation.outer.* keys"),
        (["federation.chunk_size=1.5"], "federation.chunk_size=1.5: must be an integer"),
        (["checkpoint.async=maybe"], "checkpoint.async='maybe': must be true or false"),
        (["seed=x"], "seed='x': must be an integer (e.g. seed=0)"),
        (
            ["model=no_such_model"],
            "model=no_such_model: no such option (conf/model/no_such_model.yaml); available: hf,",
        ),
    ],
)
def test_bad_keys_and_types_fail_with_one_line(overrides, needle):
    line = one_line_error(overrides)
    assert line is not None and needle in line and "\n" not in line, line


def test_a_preset_file_with_a_bad_key_or_type_is_named(tmp_path):
    """Experiment files merge into the schema too: the line names the file and the key."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "typo.yaml").write_text("# @package _global_\ntrain:\n  stepz: 3\n")
    (tmp_path / "experiment" / "warmup.yaml").write_text("# @package _global_\noptim:\n  warmup_steps: null\n")
    lines = []
    for name in ("typo", "warmup"):
        with pytest.raises(Exception) as info:
            compose([f"hydra.searchpath=[file://{tmp_path}]", f"+experiment={name}"])
        lines.append(compose_error(info.value))
    assert lines[0] == (
        "conf/experiment/typo.yaml sets train.stepz, which is not a config key: check the spelling "
        "(xffl_like/config/schema.py)"
    )
    assert lines[1].startswith("conf/experiment/warmup.yaml sets optim.warmup_steps: ") and "\n" not in lines[1]


def test_workers_receive_the_typed_config(monkeypatch, tmp_path):
    """run_local hands the launcher's validated JobConfig (frozen, picklable) to the workers, equal to the
    config.yaml it saved; nothing is launched here (launch_local is replaced)."""
    import pickle

    from omegaconf import OmegaConf

    import xffl_like.job as job_module

    sent = {}
    monkeypatch.setattr(job_module, "launch_local", lambda worker, args, nproc, **kw: sent.update(args=args) or [{}])
    cfg = compose(["+experiment=llama_fed", "optim=sgd", "federation=diloco", "federation.weights=[1,3]"])
    job_module.run_local(cfg, tmp_path / "run")
    job = sent["args"][0]
    assert (
        type(job) is JobConfig and type(job.data) is DataConfig and type(job.federation.outer).__name__ == "OuterConfig"
    )
    with pytest.raises(FrozenInstanceError):
        job.federation.every = 3
    assert pickle.loads(pickle.dumps(job)) == job
    saved = OmegaConf.to_container(OmegaConf.load(tmp_path / "run" / "config.yaml"))
    assert {**asdict(job), "optim": saved["optim"]} == saved
    assert job.optim.name == "sgd" and job.optim.momentum == 0.9 and job.federation.outer.name == "nesterov"
    assert job.federation.weights == [1, 3] and job.federation.outer.lr == 0.7
    with pytest.raises(TypeError):  # sections are read as attributes only (no mapping view)
        job["federation"]


# ----------------------------------------------------------------------------- GPU launch, CPU-visible
def test_backend_strings_and_exchange_on_nccl():
    assert resolve_backend("auto", cuda_available=False) == "gloo"
    assert resolve_backend("auto", cuda_available=True) == "nccl"
    assert resolve_backend("gloo", cuda_available=True) == "gloo"
    assert group_backend("nccl") == "cpu:gloo,cuda:nccl" and group_backend("gloo") == "gloo"
    check_collective("exchange", "gloo")
    check_collective("all_reduce", "nccl")
    check_collective(None, "nccl")
    with pytest.raises(
        ValueError, match=r"bench.collective=exchange is for gloo; on nccl use bench.collective=all_reduce"
    ):
        check_collective("exchange", "nccl", "bench.collective")


class FakeEvent:
    """Stands in for torch.cuda.Event: a timestamp on a fake GPU timeline, done when ``ready``."""

    clock = 0.0
    ready = False

    def record(self):
        self.at = FakeEvent.clock

    def query(self):
        return FakeEvent.ready

    def synchronize(self):
        FakeEvent.synced += 1

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


def test_phase_timer_events_on_cuda_and_clock_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("no device-wide synchronise per phase"))
    FakeEvent.synced = 0
    timer = PhaseTimer(torch.device("cuda", 0), event=FakeEvent)
    for phase, seconds in (("forward", 2.0), ("backward", 3.0), ("forward", 0.5)):
        with timer(phase):
            FakeEvent.clock += seconds
    assert len(timer._pending) == 3  # nothing finished yet: nothing folded, nothing waited on
    FakeEvent.ready = True
    with timer("data"):
        FakeEvent.clock += 0.25
    assert not timer._pending and FakeEvent.synced == 0  # finished pairs folded without blocking
    FakeEvent.ready = False
    with timer("optimizer"):
        FakeEvent.clock += 1.0
    assert timer.seconds == {"data": 0.25, "forward": 2.5, "backward": 3.0, "optimizer": 1.0,
                             **dict.fromkeys(("aggregation", "eval", "checkpoint", "wait", "log"), 0.0)}  # fmt: skip
    assert FakeEvent.synced == 1  # reading waits for the one still in flight

    ticks = iter([10.0, 10.5, 20.0, 23.0])
    cpu = PhaseTimer(torch.device("cpu"), clock=lambda: next(ticks), event=FakeEvent)
    with cpu("forward"):
        pass
    with cpu("aggregation"):
        pass
    assert cpu.seconds == {"data": 0.0, "forward": 0.5, "backward": 0.0, "optimizer": 0.0, "aggregation": 3.0,
                           **dict.fromkeys(("eval", "checkpoint", "wait", "log"), 0.0)}  # fmt: skip
