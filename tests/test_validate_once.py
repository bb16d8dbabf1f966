"""Each config section is checked exactly once in the launcher: validate_config runs every section's
validator one time (a second run, or a missing one, fails here)."""

from __future__ import annotations

from pathlib import Path

import xffl_like.checkpoint.resume as resume
import xffl_like.config as config
import xffl_like.federation.elastic as elastic
import xffl_like.federation.options as fed_options
import xffl_like.federation.pace as pace
import xffl_like.parallel.options as parallel_options
from xffl_like.job import CONF_DIR, choices, resolve
from xffl_like.schema import JobConfig, job_config

# (module, function name) of every section's validator that validate_config reaches.
VALIDATORS = [
    (config, "validate_distributed"),
    (config, "validate_train"),
    (config, "validate_optim"),
    (config, "validate_logger"),
    (config, "validate_export"),
    (config, "resolve_model"),
    (config, "plan_layout"),
    (parallel_options, "validate_parallel"),
    (fed_options, "validate_federation"),
    (fed_options, "validate_outer"),
    (resume, "validate_durability"),
    (fed_options, "validate_pace"),
    (pace, "check_pace_job"),
    (config, "_check_slow_fault"),
    (elastic, "validate_elastic"),
]


def test_every_section_validator_runs_exactly_once(monkeypatch):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        composed = compose(
            config_name="config", overrides=["+experiment=llama_fed", "logger=none"], return_hydra_config=True
        )
    job = job_config(resolve(composed), choices(composed))
    calls: dict[str, int] = {}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return wrapper

    for module, name in VALIDATORS:
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    # validate_config imports these by name at call time from their packages: wrap those bindings too.
    import xffl_like.aggregation as aggregation
    import xffl_like.data as data
    import xffl_like.federation as federation

    monkeypatch.setattr(federation, "validate_federation", fed_options.validate_federation)
    for module, name in ((aggregation, "validate_strategy_options"), (data, "validate_data")):
        monkeypatch.setattr(module, name, counted(name, getattr(module, name)))

    validated, layout = config.validate_config(job, 4, 4, Path.cwd())
    expected = {name: 1 for _, name in VALIDATORS} | {"validate_strategy_options": 1, "validate_data": 1}
    assert calls == expected
    assert isinstance(validated, JobConfig) and layout.num_facilities == 2


def test_the_federation_section_is_planned_once_with_a_schedule(monkeypatch):
    """With a schedule, the section's validator still runs once (it checks each phase itself)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        composed = compose(
            config_name="config",
            overrides=[
                "+experiment=llama_fed",
                "logger=none",
                "federation.schedule=[{until_step:4,algorithm:synchronous},{until_step:null}]",
            ],
            return_hydra_config=True,
        )
    job = job_config(resolve(composed), choices(composed))
    calls = []
    original = fed_options.validate_federation
    monkeypatch.setattr(fed_options, "validate_federation", lambda *a, **k: calls.append(1) or original(*a, **k))
    import xffl_like.federation as federation

    monkeypatch.setattr(federation, "validate_federation", fed_options.validate_federation)
    config.validate_config(job, 4, 4, Path.cwd())
    assert calls == [1]
