"""Test-process settings shared by every test module, and a map of the suite.

Layout:

- ``tests/test_*.py``: the tests, one module per area (pure functions, multi-process cases,
  jobs through the CLI). A test module imports from ``helpers`` and ``workers``, never from
  another test module.
- ``tests/helpers/``: plain constants and functions shared by test modules (``REPO``, ``CONF``,
  ``TINY``, ``run_cli``, ``run_recorded``; ``helpers.round_values`` recomputes a job's rounds).
- ``tests/workers/``: code that runs in the processes a test starts: functions handed to
  ``launch_local`` (spawned ranks import them by name) and scripts run with
  ``python -m workers.<name>``.

This file puts ``tests/`` on ``sys.path`` (whatever pytest's import mode), so ``import helpers``
and ``import workers`` work here and in spawned ranks, which inherit the path.

Tiers (markers registered in pyproject.toml, ``--strict-markers``):

- ``multiprocess``: starts several processes (``launch_local``, torchrun, mpiexec).
- ``cli``: runs the CLI (``python -m xffl_like.run`` and the other entry points) in a subprocess.
- ``slow``: the slowest tests (over ~10 s each here, mostly whole jobs).

``python -m pytest -q`` runs everything; ``python -m pytest -q -m "not slow"`` is the fast tier
(a couple of minutes); ``-m "not multiprocess and not cli"`` keeps to the pytest process.

Fixtures shared by several modules:

- ``gloo_world``: a one-process gloo world in the pytest process and its ``DistributedState`` (one
  facility of one rank); the process group is destroyed afterwards, whatever the test did.
- ``killed_at_7``: the durability job (``helpers.same_run.KILLED_AT_7``) run once per session, rank 1
  killed at step 7; test_durability and test_run_dir_safety read it (copy it before changing anything).

Workers (pytest-xdist, ``-n auto --dist loadscope`` in pyproject.toml): the suite runs on
:func:`pytest_xdist_auto_num_workers` pytest processes, a module's tests on one of them (its module-scoped
fixtures and shared jobs built once). Most tests start processes and then wait on them (a job's ranks, a
hub, a launcher), so two workers overlap one module's waits with another's work even on 2 cores (three
were no faster there, 16:35 against two's 16:19-16:27: each test took about twice as long). The costliest
modules are handed out first (:func:`pytest_collection_modifyitems`, ``module_costs.json``), so that the
longest modules do not start last. ``-n 0`` runs everything in this process, as before;
``PYTEST_XDIST_AUTO_NUM_WORKERS=N`` sets the number. A session fixture shared by several modules
(``killed_at_7``) runs once for the whole run, under a file lock in the run's common temporary folder.
"""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

# In-process computations (value checks, simulations, single-process models) are tiny: one
# intra-op thread is as fast, and it does not fight the multi-process tests' workers for the
# machine's cores (two threads under load made a value check 40x slower).
torch.set_num_threads(1)


@pytest.fixture
def gloo_world(tmp_path_factory):
    """A one-process gloo world in the pytest process: the default process group (a file store in a
    fresh folder) and the :class:`~xffl_like.distributed.state.DistributedState` of one facility of one
    rank (``plan_layout(1, 1, 1, 1)``, CPU), yielded. The default group and every group of the state
    are destroyed afterwards, however the test ended: other tests expect no process group here."""
    import torch.distributed as dist

    from xffl_like.distributed.env import ProcessEnv
    from xffl_like.distributed.layout import plan_layout
    from xffl_like.distributed.state import build_state

    assert not dist.is_initialized(), "a default process group was left in the pytest process"
    store = tmp_path_factory.mktemp("gloo_world") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield build_state(plan_layout(1, 1, 1, 1), ProcessEnv(0, 1, 0, 1), backend="gloo")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def killed_at_7(tmp_path_factory):
    """``(run directory, CompletedProcess)`` of ``helpers.same_run.KILLED_AT_7``, run once per test run (one job
    fewer in the suite), whatever the number of workers: rank 1 SIGKILLed at step 7, checkpoints of steps 4
    and 6. Read-only for the tests."""
    from filelock import FileLock
    from helpers.same_run import KILLED_AT_7, run_job

    if not os.environ.get("PYTEST_XDIST_WORKER"):  # no workers (-n 0, -p no:xdist)
        run = tmp_path_factory.mktemp("killed_at_7") / "run"
        return run, run_job(KILLED_AT_7, run)
    shared = tmp_path_factory.getbasetemp().parent  # the same folder for every worker of this run
    run, record = shared / "killed_at_7" / "run", shared / "killed_at_7.json"
    with FileLock(str(record) + ".lock"):
        if not record.is_file():
            proc = run_job(KILLED_AT_7, run)
            record.write_text(json.dumps([proc.args, proc.returncode, proc.stdout, proc.stderr]))
    return run, subprocess.CompletedProcess(*json.loads(record.read_text()))


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: half the cores (each test's processes use the rest), at least 2 where there are 2 (most
    tests wait on their processes much of the time); ``PYTEST_XDIST_AUTO_NUM_WORKERS`` wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, max(2, cores // 2))


def pytest_configure(config):
    """Once per run, in the controller: the package's and the tests' bytecode cached in ``__pycache__`` (ignored by
    git). Where ``PYTHONDONTWRITEBYTECODE`` is set (this machine and CI set it) no import writes it, so each of the
    run's hundreds of processes (launchers, fork servers, hubs, CLI calls) compiled the modules it imports again,
    about 0.1 s of CPU each; ``compileall`` writes the cache whatever that variable says, and imports read it."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import compileall

    root = Path(_TESTS).parent
    for folder in ("xffl_like", "tests", "hydra_plugins"):
        if (root / folder).is_dir():
            compileall.compile_dir(str(root / folder), quiet=2)


_COSTS = Path(_TESTS) / "module_costs.json"


def pytest_collection_modifyitems(config, items):
    """The costliest modules first, by ``module_costs.json`` (seconds per module in a measured run; a module not
    in it counts 0), stable otherwise. With ``--dist loadscope --no-loadscope-reorder`` a module runs on one
    worker in this order: a long module handed out last would run alone at the end. Refresh the file with
    ``XFFL_TEST_COSTS_OUT=tests/module_costs.json python -m pytest -q``."""
    costs = json.loads(_COSTS.read_text()) if _COSTS.is_file() else {}
    items.sort(key=lambda item: -costs.get(item.nodeid.split("::")[0], 0))


_SPENT: Counter = Counter()


def pytest_runtest_logreport(report):
    """Every phase's seconds, by module (in the controller, which sees every worker's reports)."""
    if os.environ.get("XFFL_TEST_COSTS_OUT"):
        _SPENT[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session):
    """``XFFL_TEST_COSTS_OUT=PATH``: the seconds by module of this run, for :func:`pytest_collection_modifyitems`."""
    out = os.environ.get("XFFL_TEST_COSTS_OUT")
    if out and _SPENT and not os.environ.get("PYTEST_XDIST_WORKER"):
        Path(out).write_text(json.dumps({k: round(v) for k, v in _SPENT.most_common() if v >= 1}, indent=0) + "\n")
