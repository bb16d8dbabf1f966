"""Each config section is checked exactly once in the launcher: validate_config walks its one table
(config.VALIDATORS) once, and every owner's validator it reaches runs one time (a second run, or a
missing one, fails here)."""

from __future__ import annotations

import inspect
from pathlib import Path

import xffl_like.checkpoint.resume as resume
import xffl_like.config.validate as config
import xffl_like.federation.elastic as elastic
import xffl_like.federation.options as fed_options
import xffl_like.federation.pace as pace
import xffl_like.parallel.options as parallel_options
from xffl_like.config.schema import JobConfig, job_config
from xffl_like.job import CONF_DIR, choices, resolve

# (module, function name) of the owners' validators that the table's checks reach, each once.
OWNERS = [
    (config, "resolve_model"),
    (config, "plan_layout"),
    (parallel_options, "validate_parallel"),
    (parallel_options, "check_parallel_job"),
    (fed_options, "validate_federation"),
    (fed_options, "validate_outer"),
    (resume, "validate_durability"),
    (fed_options, "validate_pace"),
    (pace, "check_pace_job"),
    (elastic, "validate_elastic"),
]


def _compose(*overrides: str) -> JobConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        composed = compose(
            config_name="config",
            overrides=["+experiment=llama_fed", "logger=none", *overrides],
            return_hydra_config=True,
        )
    return job_config(resolve(composed), choices(composed))


def test_the_table_has_one_signature_and_unique_names():
    names = [name for name, _ in config.VALIDATORS]
    assert len(names) == len(set(names))
    for name, check in config.VALIDATORS:
        assert list(inspect.signature(check).parameters) == ["job", "ctx"], name


def test_every_section_validator_runs_exactly_once(monkeypatch):
    job = _compose()
    calls: dict[str, int] = {}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    table = tuple((name, counted(f"table:{name}", check)) for name, check in config.VALIDATORS)
    monkeypatch.setattr(config, "VALIDATORS", table)
    for module, name in OWNERS:
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    # The table's checks import these by name at call time from their packages: wrap those bindings too.
    import xffl_like.aggregation as aggregation
    import xffl_like.data as data
    import xffl_like.federation as federation

    monkeypatch.setattr(federation, "validate_federation", fed_options.validate_federation)
    for module, name in ((aggregation, "validate_strategy_options"), (data, "validate_data")):
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    normalised = []
    original_normalise = config.normalise
    monkeypatch.setattr(config, "normalise", lambda *a: normalised.append(1) or original_normalise(*a))

    validated, layout = config.validate_config(job, 4, 4, Path.cwd())
    expected = (
        {f"table:{name}": 1 for name, _ in config.VALIDATORS}
        | {name: 1 for _, name in OWNERS}
        | {"validate_strategy_options": 1, "validate_data": 1}
    )
    assert calls == expected
    assert normalised == [1]
    assert isinstance(validated, JobConfig) and layout.num_facilities == 2


def test_the_federation_section_is_planned_once_with_a_schedule(monkeypatch):
    """With a schedule, the section's validator still runs once (it checks each phase itself)."""
    job = _compose("federation.schedule=[{until_step:4,algorithm:synchronous},{until_step:null}]")
    calls = []
    original = fed_options.validate_federation
    monkeypatch.setattr(fed_options, "validate_federation", lambda *a, **k: calls.append(1) or original(*a, **k))
    import xffl_like.federation as federation

    monkeypatch.setattr(federation, "validate_federation", fed_options.validate_federation)
    config.validate_config(job, 4, 4, Path.cwd())
    assert calls == [1]


def test_normalise_is_the_one_rewrite():
    """The checks leave the job as composed; normalise writes hsdp=1 for a full copy per rank, adamw's betas a pair."""
    job = _compose("parallel=decentralized", "federation=default")
    assert job.distributed.hsdp is None and job.optim.betas == [0.9, 0.95]
    validated, layout = config.validate_config(job, 4, 4, Path.cwd())
    assert validated.distributed.hsdp == 1 and layout.shard_size == 1
    assert validated.optim.betas == (0.9, 0.95)
    assert job.distributed.hsdp is None and job.optim.betas == [0.9, 0.95]  # the checks rewrote nothing


#: What only the workers need (about 1.2 s of CPU together in every launcher that imported them).
WORKERS_ONLY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch._dynamo")


def test_the_launcher_checks_a_job_without_the_workers_modules(tmp_path):
    """A fresh interpreter runs ``python -m xffl_like.run`` up to the launch (``launch_local`` replaced by a
    probe that reports and exits): the whole check ran (its model built on meta) and none of WORKERS_ONLY was
    imported."""
    import json
    import os
    import subprocess
    import sys

    from helpers import PYTHONPATH, REPO

    probe = (
        "import json, runpy, sys\n"
        "import xffl_like.distributed.launch as launch\n"
        "def probe(*args, **kwargs):\n"
        f"    print(json.dumps(sorted(m for m in {WORKERS_ONLY!r} if m in sys.modules)))\n"
        "    raise SystemExit(0)\n"
        "launch.launch_local = probe\n"
        f"sys.argv = ['xffl_like.run', '+experiment=llama_fed', 'logger=none', 'hydra.run.dir={tmp_path}']\n"
        "runpy.run_module('xffl_like.run', run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [], proc.stdout
