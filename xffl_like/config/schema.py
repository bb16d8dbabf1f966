"""The job's typed config: one frozen dataclass per component, the root :class:`JobConfig`.

Registered in Hydra's ConfigStore as ``job_schema`` (first in ``conf/config.yaml``'s defaults),
the dataclasses make composition reject unknown keys and values of the wrong primitive type
(``optim.warmup_steps=null``, ``train.steps=abc``) before anything else runs; the YAML files
only carry presets. Hydra lets ``+key=value`` add keys past a schema, so :func:`check_keys`
walks the composed tree once more in the launcher. :func:`job_config` turns the validated,
resolved dict into the :class:`JobConfig` that workers receive.

A section that several options share (``data``: synthetic, text, tokens; ``optim``: adamw,
sgd; ``model``: a shape or ``hf``) holds the union of their keys; each source reads its own.
Adding a key: one field (type, default, comment) in its dataclass, the same default in the
YAML files that carry it, a row in ``docs/config.md``. Sections are read as attributes
(``cfg.every``); :func:`as_plain` gives the plain dict where one is needed (JSON, W&B, ``config.yaml``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any, Union

from omegaconf import MISSING

from .checks import is_int, is_number
from .errors import ConfigError

__all__ = [
    "ACTIVATION_CHECKPOINTING",
    "OPTIMIZERS",
    "SCHEDULES",
    "CheckpointConfig",
    "DataConfig",
    "DistributedConfig",
    "ElasticConfig",
    "ExportConfig",
    "FaultConfig",
    "FederationConfig",
    "JobConfig",
    "LoggerConfig",
    "ModelConfig",
    "OptimConfig",
    "OuterConfig",
    "ParallelConfig",
    "StrategyConfig",
    "TopkConfig",
    "TrainConfig",
    "as_plain",
    "check_keys",
    "job_config",
    "register",
    "section_of",
    "unknown_key_message",
]

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "cosine", "linear")
ACTIVATION_CHECKPOINTING = ("none", "full")
_DTYPES = ("auto", "float32", "bfloat16")
#: ``train.compile``: ``auto`` compiles on CUDA only.
COMPILE = ("auto", True, False)
Number = Union[int, float]  # keeps 25 an int and 0.25 a float (sweep directory names, the saved config)


class Section:
    """Base of the config sections (frozen dataclasses; read their fields as attributes: ``cfg.every``)."""


@dataclass(frozen=True)
class DistributedConfig(Section):
    """``conf/distributed/*.yaml``: how processes are laid out."""

    nproc_per_node: int = 4  # local workers to launch (ignored under torchrun/srun)
    federated: Any = 2  # facility size (int), list of sizes, or null: one facility
    hsdp: int | None = None  # shard size inside a facility; null: the whole facility
    backend: str = "auto"  # auto | gloo | nccl
    timeout_s: int = 300  # collective timeout
    max_restarts: int = 0  # elastic restarts of all workers after a failure


@dataclass(frozen=True)
class ModelConfig(Section):
    """``conf/model/*.yaml``: the Llama shape; ``model=hf`` fills the shape from ``path``'s config.json."""

    name: str = "llama_tiny"
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    vocab_size: int | None = None
    ffn_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    rope_scaling: Any = None  # Llama 3.1 RoPE scaling (a mapping, checked by LlamaConfig); null: plain RoPE
    tie_embeddings: bool = False
    init: str = "full"  # full | meta
    path: str | None = None  # a local Hugging Face directory (model=hf)


@dataclass(frozen=True)
class DataConfig(Section):
    """``conf/data/*.yaml``: the union of the sources' keys (synthetic reads name, num_eval_batches, non_iid)."""

    name: str = "synthetic"  # synthetic | text | tokens
    num_eval_batches: int = 4
    non_iid: float = 0.5  # synthetic: 0 = one distribution for all facilities, 1 = each its own
    path: Any = None  # text: a file or a list of files; tokens: the directory written by prepare
    partition: str = "contiguous"  # text, tokens: contiguous | interleaved
    tokenizer: str | None = "byte"  # text: byte or a tokenizer.json / a directory holding one
    eval_fraction: float = 0.1  # text, tokens: held-out tail
    block_size: int = 65536  # text, tokens: block size for partition=interleaved


@dataclass(frozen=True)
class StrategyConfig(Section):
    """``conf/strategy/*.yaml``: how weights are averaged across facilities."""

    name: str = "fused"
    streams: int = 1
    bucket_mb: Number = 64
    mode: str = "split"  # split | one_sender
    only: list[str] | None = None  # parameter-name globs or module class names; null: all
    transport: str = "torch"  # torch | mpi


@dataclass(frozen=True)
class OptimConfig(Section):
    """``conf/optim/*.yaml``, checked by :meth:`check`, then :meth:`normalised` (both: :meth:`from_mapping`).
    A key of the other optimizer must keep its default (``optim.momentum=0.9`` under adamw would be
    silently unused: refused)."""

    #: ``adamw`` (decoupled weight decay) or ``sgd`` (momentum, L2 weight decay).
    name: str = MISSING
    #: Peak learning rate (reached at the end of the warm-up).
    lr: float = MISSING
    weight_decay: float = 0.0
    #: Linear warm-up steps from ``lr / warmup_steps`` to ``lr``.
    warmup_steps: int = 0
    #: After the warm-up: ``constant`` at ``lr``, or ``cosine`` / ``linear`` decay to ``min_lr``.
    schedule: str = "constant"
    #: Learning rate of the last step for ``cosine`` and ``linear`` (ignored by ``constant``).
    min_lr: float = 0.0
    #: ``False``: norms, biases and embeddings get no weight decay (models.params.decay_groups);
    #: ``True``: every parameter does.
    decay_all: bool = False
    #: Max global gradient norm; 0 disables clipping.
    grad_clip: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adamw (checked: a pair)
    eps: float = 1e-8  # adamw
    momentum: float = 0.0  # sgd

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> OptimConfig:
        """Build from the plain ``optim`` mapping (``as_plain(job.optim)``): :meth:`check` it and return it
        :meth:`normalised`; one-line :class:`~xffl_like.config.errors.ConfigError` naming the key and the fix."""
        section = cls(**{key: m.get(key, default) for key, default in _OPTIM_GIVEN.items()})
        section.check()
        return section.normalised()

    def check(self) -> None:
        """Every ``optim.*`` value (the launcher's ``optim`` check; :meth:`from_mapping` for a mapping):
        one-line :class:`~xffl_like.config.errors.ConfigError` naming the key and the fix."""
        name = self.name
        if name not in OPTIMIZERS:
            raise ConfigError(
                f"optim.name={name!r}: use one of {', '.join(OPTIMIZERS)} (e.g. optim=adamw or optim=sgd)"
            )
        warmup = self.warmup_steps
        if not is_int(warmup) or warmup < 0:
            raise ConfigError(f"optim.warmup_steps={warmup!r}: must be an integer >= 0 (e.g. optim.warmup_steps=0)")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"optim.schedule={self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        if not isinstance(self.decay_all, bool):
            raise ConfigError(f"optim.decay_all={self.decay_all!r}: must be true or false")
        lr, min_lr = self._number("lr", strict=True), self._number("min_lr")
        if min_lr > lr:
            raise ConfigError(
                f"optim.min_lr={min_lr:g} exceeds optim.lr={lr:g}: the schedule decays from lr down to "
                f"min_lr, so set optim.min_lr <= optim.lr"
            )
        for key, (owner, default) in _OPTIM_OWN.items():
            value = getattr(self, key)
            value = list(value) if isinstance(value, tuple) else value  # betas: a list in YAML, a tuple in code
            if owner != name and value != default:
                raise ConfigError(
                    f"optim.{key}={value!r} applies to optim={owner}, not optim={name}: "
                    f"drop it, or select that optimizer with optim={owner} (the group, not optim.name)"
                )
        if name == "adamw":
            betas = self.betas
            if not (
                isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_number(b) and 0 <= b < 1 for b in betas)
            ):
                raise ConfigError(f"optim.betas={betas!r}: must be two numbers in [0, 1) (e.g. optim.betas=[0.9,0.95])")
            self._number("eps", strict=True)
        elif self._number("momentum") >= 1:
            raise ConfigError(f"optim.momentum={float(self.momentum):g}: must be in [0, 1) (e.g. optim.momentum=0.9)")
        self._number("weight_decay"), self._number("grad_clip")

    def _number(self, key: str, strict: bool = False) -> float:
        """``optim.<key>`` as a float: a finite number >= 0 (> 0 if ``strict``)."""
        value, default = getattr(self, key), _OPTIM_GIVEN[key]
        if not _number(value) or value < 0 or (strict and value == 0):
            what = "a positive number" if strict else "a number >= 0"
            raise ConfigError(f"optim.{key}={value!r}: must be {what} (e.g. optim.{key}={default})")
        return float(value)

    def normalised(self) -> OptimConfig:
        """The checked section as workers read it: the numbers floats, adamw's ``betas`` a pair of floats,
        the other optimizer's keys at their defaults."""
        if self.name == "adamw":
            own: dict[str, Any] = {"betas": (float(self.betas[0]), float(self.betas[1])), "eps": float(self.eps)}
        else:
            own = {"momentum": float(self.momentum)}
        return type(self)(
            name=self.name,
            lr=float(self.lr),
            weight_decay=float(self.weight_decay),
            warmup_steps=self.warmup_steps,
            schedule=self.schedule,
            min_lr=float(self.min_lr),
            decay_all=self.decay_all,
            grad_clip=float(self.grad_clip),
            **own,
        )


#: ``optim.*`` -> the value :meth:`OptimConfig.from_mapping` takes where a mapping lacks the key.
_OPTIM_GIVEN: dict[str, Any] = {
    "name": None,
    "lr": 1e-3,
    "weight_decay": 0.0,
    "warmup_steps": 0,
    "schedule": "constant",
    "min_lr": 0.0,
    "decay_all": False,
    "grad_clip": 0.0,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "momentum": 0.0,
}
_OPTIM_OWN = {"betas": ("adamw", [0.9, 0.999]), "eps": ("adamw", 1e-8), "momentum": ("sgd", 0.0)}


@dataclass(frozen=True)
class OuterConfig(Section):
    """``federation.outer``: the outer optimizer on the pseudo-gradient theta_global - mean."""

    name: str = "average"  # average | nesterov | momentum | adam
    lr: float = 1.0
    momentum: float = 0.0  # nesterov / momentum
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])  # adam
    eps: float = 1e-8  # adam
    offload: bool = False  # theta_global and the outer state in (pinned) host memory

    @property
    def is_plain_mean(self) -> bool:
        """``average`` with lr 1: the new global weights are the mean itself (no state needed)."""
        return self.name == "average" and self.lr == 1.0


@dataclass(frozen=True)
class TopkConfig(Section):
    """``federation.topk``: ``compression=topk``, SparseLoCo's sparse messages (``federation/topk.py``)."""

    density: float = 0.03125  # fraction of each tile's values sent, in (0, 1] (128 of a 64 x 64 tile)
    bits: int = 2  # 2 | 4 | 8: the sent values' quantization, 2**bits bins per tensor
    decay: float = 0.95  # the error-feedback accumulator's decay beta: e = beta * e + update (SparseLoCo: 0.95)
    tile: int = 64  # the tile's side (a dimension's largest divisor <= tile)
    chunks: str = "tiles"  # tiles (tile x tile of each tensor, SparseLoCo) | flat (chunk_size values, across tensors)
    quantizer: str = "bins"  # bins (2**bits bins per tensor, SparseLoCo) | levels (symmetric levels, a scale per chunk)
    preset: str | None = None  # set by federation/topk=NAME (conf/federation/topk/): its keys are checked


@dataclass(frozen=True)
class ElasticConfig(Section):
    """``federation.elastic``: each facility its own job, rounds held by the hub (``federation/elastic/``,
    :mod:`xffl_like.hub`); without ``hub`` every facility lives in one world, as before."""

    hub: str | None = None  # HOST:PORT of `python -m xffl_like.hub serve` (dialled out to, mutual TLS); null: one world
    ca: str | None = None  # the hub's ca.crt (from `python -m xffl_like.hub init`)
    cert: str | None = None  # this facility's certificate (its common name is the facility's name)
    key: str | None = None  # this facility's private key
    facility: str | None = None  # this facility's unique name; null: its certificate's, or the Slurm job's or host's
    min_facilities: int = 1  # training starts once this many facilities are present
    timeout_s: float = 60.0  # seconds a call to the hub may take (the launcher's check, a round's control calls)
    rewarm: bool = True  # a joiner with a fresh inner optimizer warms its lr up again over optim.warmup_steps
    final_wait_s: float = 600.0  # at its last step without the federation's final version: ask this long, then fail
    grace_s: float = 60.0  # hub: a round closes this long after it opened, whoever has not arrived
    max_norm_ratio: float = 10.0  # hub: an update norm over this many times the median is rejected
    aggregate: str = "mean"  # hub: mean (weighted) | median | trimmed_mean (coordinate-wise over members, unweighted)
    trim: float = 0.2  # hub, aggregate=trimmed_mean: ceil(trim x members) cut from each end, per coordinate

    @property
    def enabled(self) -> bool:
        """Each facility is its own job, meeting the others at the hub; else one world."""
        return bool(self.hub)


@dataclass(frozen=True)
class FederationConfig(Section):
    """``conf/federation/*.yaml``: what happens across facilities."""

    algorithm: str = "federated"  # federated | synchronous
    every: Any = 10  # local optimizer steps per round: a number, one per facility (a list), or null with every_s
    every_s: float | None = None  # rounds bounded by wall time: each facility steps until T seconds would pass
    weights: Any = None  # null (uniform; tokens when facilities take different steps) | uniform | tokens | a list
    topology: str = "complete"  # complete | ring | one-peer-exp | alternating-exp-ring
    outer: OuterConfig = field(default_factory=OuterConfig)
    compression: str = "none"  # none | bf16 | uint8 | topk
    chunk_size: int = 4096  # values per min-max chunk (uint8), per top-k chunk (topk with topk.chunks=flat)
    error_feedback: bool | None = None  # null: the compression's own (topk: on; bf16, uint8: off)
    topk: TopkConfig = field(default_factory=TopkConfig)
    delay: int = 0  # 1: a round's outer step is applied one round late, its exchange overlapping the next round
    delay_rule: str | None = None  # delay=1: eager (null: the default; arXiv 2502.12996) | own_full (the rule before)
    fragments: int = 1  # contiguous fragments of the blocks, synced at staggered steps (Streaming DiLoCo)
    overlap_steps: int = 0  # a fragment's exchange starts this many steps before it is applied
    merge_alpha: float = 0.5  # with overlap: merge_alpha * local + (1 - merge_alpha) * new global
    schedule: list[Any] | None = None  # phases: a list of {until_step, any federation keys}
    on_nonfinite: str = "fail"  # fail | skip
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    @property
    def feedback(self) -> bool:
        """Error feedback on: ``error_feedback``, or by default with ``compression=topk`` (its accumulator)."""
        return self.compression == "topk" if self.error_feedback is None else bool(self.error_feedback)

    @property
    def streaming(self) -> bool:
        """Fragments synced at staggered steps, or exchanges overlapped with local steps (federation/streaming.py)."""
        return self.fragments > 1 or self.overlap_steps > 0

    @property
    def paced(self) -> bool:
        """Facilities take different numbers of steps per round: ``every`` a list, or ``every_s``
        (federation/pace.py)."""
        return self.every_s is not None or isinstance(self.every, (list, tuple))

    @property
    def mean_weights(self) -> Any:
        """The weights of a round's mean: ``weights``, or for ``null`` ``tokens`` when facilities take
        different steps per round (``paced``) and ``uniform`` otherwise."""
        if self.weights is None:
            return "tokens" if self.paced else "uniform"
        return self.weights


@dataclass(frozen=True)
class TrainConfig(Section):
    """``conf/train/default.yaml``, checked by :meth:`check` (:meth:`from_mapping` for a plain mapping)."""

    #: Local optimizer steps in total.
    steps: int = MISSING
    #: Sequences per rank per micro-batch.
    batch_size: int = MISSING
    #: Tokens per sequence.
    seq_len: int = MISSING
    #: ``auto`` (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16: the compute dtype; weights and the
    #: gradient reduction stay float32 (FSDP2's MixedPrecisionPolicy).
    dtype: str = "auto"
    #: ``torch.compile`` each decoder block (as torchtitan): ``auto`` on CUDA only, ``true``, ``false``.
    compile: Any = "auto"
    log_every: int = 10
    #: Micro-batches per optimizer step; gradients are reduced inside the facility only after the last.
    grad_accum: int = 1
    #: ``full``: every decoder block recomputes its activations in the backward pass.
    activation_checkpointing: str = "none"
    #: Sequence positions per chunk of the loss head (final norm, output projection, cross-entropy).
    loss_chunk: int = 1024
    #: Steps between evaluations of the local model (0: only right before and after each aggregation).
    eval_every: int = 0

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> TrainConfig:
        """Build from the plain ``train`` mapping (keys other components own are ignored) and :meth:`check`
        it; one-line :class:`~xffl_like.config.errors.ConfigError` on a bad value."""
        section = cls(**{key: m.get(key, default) for key, (_, default) in _TRAIN_RULES.items()})
        section.check()
        return section

    def check(self) -> None:
        """Every ``train.*`` value, in the order of :data:`_TRAIN_RULES` (the launcher's ``train`` check;
        :meth:`from_mapping` for a mapping): one-line :class:`~xffl_like.config.errors.ConfigError`."""
        for key, (rule, _) in _TRAIN_RULES.items():
            value = getattr(self, key)
            if isinstance(rule, tuple):
                if value not in rule or type(value) not in {type(r) for r in rule}:  # 1 == True: not a bool
                    options = ", ".join(str(r).lower() if isinstance(r, bool) else r for r in rule)
                    raise ConfigError(f"train.{key}={value!r}: use one of {options}")
            elif not is_int(value) or value < rule:
                raise ConfigError(
                    f"train.{key}={value!r}: must be an integer >= {rule} (e.g. train.{key}={max(rule, 1)})"
                )


#: ``train.*`` -> (the least integer or the options, the value :meth:`TrainConfig.from_mapping` takes where a
#: mapping lacks the key); checked in this order.
_TRAIN_RULES: dict[str, tuple[Any, Any]] = {
    "steps": (0, None),
    "batch_size": (1, None),
    "seq_len": (1, None),
    "dtype": (_DTYPES, "auto"),
    "compile": (COMPILE, "auto"),
    "log_every": (1, 10),
    "grad_accum": (1, 1),
    "activation_checkpointing": (ACTIVATION_CHECKPOINTING, "none"),
    "loss_chunk": (1, 1024),
    "eval_every": (0, 0),
}


@dataclass(frozen=True, init=False, repr=False, eq=False)
class CheckpointConfig(Section):
    """``conf/checkpoint/default.yaml``: DCP checkpoints."""

    every_rounds: int = 1  # rounds between checkpoints
    dir: str | None = None  # null: <run_dir>/checkpoints
    keep: int = 2  # newest checkpoints kept
    # ``async`` (write in the background) is a Python keyword: declared through the class namespace,
    # so the dataclass cannot generate __init__/__repr__/__eq__ (they would spell it); ours follow.
    __annotations__["async"] = bool
    vars()["async"] = True

    def __init__(self, **values: Any) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, values.pop(f.name) if f.name in values else f.default)
        if values:
            raise TypeError(f"CheckpointConfig got unknown keys {sorted(values)}")

    def _values(self) -> tuple[tuple[str, Any], ...]:
        return tuple((f.name, getattr(self, f.name)) for f in fields(self))

    def __repr__(self) -> str:
        return f"CheckpointConfig({', '.join(f'{k}={v!r}' for k, v in self._values())})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._values())


@dataclass(frozen=True)
class LoggerConfig(Section):
    """``conf/logger/*.yaml``: ``none`` reads only ``name``."""

    name: str = "wandb"  # none | wandb
    mode: str | None = None  # null: $WANDB_MODE, else offline | offline | online | disabled
    project: str | None = "xffl_like"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class FaultConfig(Section):
    """``fault`` (root config): fault injection for tests and demos."""

    kill_rank: int | None = None
    at_step: int | None = None
    nan_rank: int | None = None
    nan_step: int | None = None
    slow_facility: int | None = None  # this facility's steps take slow_factor times as long (a sleep after each)
    slow_factor: float = 1.0


@dataclass(frozen=True)
class ExportConfig(Section):
    """``export`` (root config): the Hugging Face export at the end of the job."""

    hf: bool = False
    max_shard_mb: Number = 2000


@dataclass(frozen=True)
class ParallelConfig(Section):
    """``conf/parallel/*.yaml``: fsdp (the federation's path), decentralized (Decent-DP) or bagua; the keys of
    the other modes keep these defaults (checked by ``xffl_like.parallel.options.validate_parallel``)."""

    name: str = "fsdp"  # fsdp | decentralized | bagua
    cpu_offload: bool = False  # fsdp, CUDA: FSDP2 CPUOffloadPolicy (params, grads, optimizer state on the host)
    topology: str = "ring"  # decentralized
    optimizer: str = "optim"  # decentralized: optim | adam | adamw | accum_adam | accum_adamw
    accum_iter: int = 4  # decentralized, accum_adam(w)
    bucket_mb: Number = 25  # decentralized and bagua
    algorithm: str = "gradient_allreduce"  # bagua
    options: Any = (
        None  # bagua: the algorithm's keyword arguments (a mapping; Any: OmegaConf cannot merge into a null Dict)
    )
    switch: list[Any] = field(default_factory=list)  # bagua: [{at_step, algorithm, options}]

    def algorithms(self) -> list[tuple[int, str, dict]]:
        """(first step, name, options) of every phase of a Bagua run, the initial one at step 0."""
        first = (0, self.algorithm, dict(self.options or {}))
        return [first] + [(s["at_step"], s["algorithm"], dict(s.get("options") or {})) for s in self.switch or []]


@dataclass(frozen=True)
class JobConfig(Section):
    """The whole job: what the launcher validates once and every worker receives."""

    experiment: str = "default"
    seed: int = 0
    resume: str | None = None  # a run dir, a checkpoint dir, or latest
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


def _number(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


def _section_type(f) -> type | None:
    """The dataclass a field nests (``FederationConfig.outer`` -> OuterConfig), else None."""
    factory = f.default_factory
    return factory if factory is not NO_DEFAULT and isinstance(factory, type) and is_dataclass(factory) else None


def section_of(dotted: str) -> tuple[type, Any] | None:
    """``(dataclass, field)`` of a dotted key (``"optim.warmup_steps"``), or None if the schema has no such key."""
    cls, found = JobConfig, None
    for part in dotted.split("."):
        if cls is None:
            return None
        match = [f for f in fields(cls) if f.name == part]
        if not match:
            return None
        found = (cls, match[0])
        cls = _section_type(match[0])
    return found


def check_keys(cfg: Mapping[str, Any], choices: Mapping[str, Any] | None = None) -> None:
    """Raise ``ConfigError`` (one line) for the first key of ``cfg`` that the schema does not have.

    Hydra's ``+key=value`` (and ``++``) adds keys past a structured config; this finds them.
    A field typed ``Any`` or as a dict (``distributed.federated``, ``model.rope_scaling``) takes any value.
    """

    def walk(node: Mapping, cls: type, prefix: str) -> None:
        known = {f.name: f for f in fields(cls)}
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if key not in known:
                raise ConfigError(unknown_key_message(dotted, choices))
            nested = _section_type(known[key])
            if nested is not None and isinstance(value, Mapping):
                walk(value, nested, f"{dotted}.")

    walk({k: v for k, v in cfg.items() if k != "hydra"}, JobConfig, "")


#: Keys that existed once: the line for each says what replaced it.
REMOVED_KEYS = {
    "federation.elastic.lighthouse": (
        "federation.elastic.lighthouse was replaced by the hub (facilities dial out to it over mutual TLS): start "
        "`python -m xffl_like.hub serve` and set federation.elastic.hub=HOST:PORT with federation.elastic.ca, cert "
        "and key (docs/running.md, Facilities behind firewalls)"
    ),
}


def unknown_key_message(dotted: str, choices: Mapping[str, Any] | None = None) -> str:
    """The one line for a key the schema does not have, naming the group option when known."""
    if dotted in REMOVED_KEYS:
        return REMOVED_KEYS[dotted]
    top = dotted.split(".")[0]
    if top == dotted:
        where = "the root config"
    elif choices and top in choices:
        where = f"{top}={choices[top]} (conf/{top}/{choices[top]}.yaml)"
    else:
        where = f"{top} ({type(getattr(JobConfig(), top, None)).__name__} in xffl_like/config/schema.py)"
    return (
        f"{dotted} is not a config key of {where}: check the spelling, or drop the override "
        f"(`+` adds keys; `--cfg job` prints the composed config)"
    )


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    if isinstance(values, cls):
        return values  # already typed
    kwargs = {}
    for f in fields(cls):
        if f.name not in values:
            continue  # the dataclass default (only hand-written dicts lack keys; compositions have them all)
        nested = _section_type(f)
        kwargs[f.name] = _build(nested, values[f.name]) if nested is not None else values[f.name]
    return cls(**kwargs)


def build_section(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of the section dataclass ``cls`` (nested sections too) from a mapping of its keys;
    no checks (a section's validator checks the values, :func:`check_keys` the keys)."""
    return _build(cls, values)


def job_config(plain: Mapping[str, Any], choices: Mapping[str, Any] | None = None) -> JobConfig:
    """The typed, frozen config, from the resolved plain dict (the launcher builds it once).

    Only the keys are checked here; :func:`xffl_like.config.validate.validate_config` checks the values
    (each section once) and returns the validated job that workers receive.
    """
    check_keys(plain, choices)
    return _build(JobConfig, {k: v for k, v in plain.items() if k != "hydra"})


def as_plain(cfg: Mapping[str, Any]) -> dict:
    """Plain nested dicts and lists (what JSON, W&B and ``config.yaml`` hold), from a typed config or a dict."""
    return asdict(cfg) if is_dataclass(cfg) else dict(cfg)


def register() -> None:
    """Store :class:`JobConfig` as ``job_schema`` in Hydra's ConfigStore (``conf/config.yaml`` lists it first)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    node = OmegaConf.structured(JobConfig)
    _writable(node)  # frozen dataclasses make read-only nodes, and the YAML presets must merge into the schema
    ConfigStore.instance().store(name="job_schema", node=node)


def _writable(node) -> None:
    from omegaconf import DictConfig

    node._set_flag("readonly", None)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
        elif child is not None:
            child._set_flag("readonly", None)
