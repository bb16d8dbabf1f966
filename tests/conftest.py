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
"""

import sys
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
    """``(run directory, CompletedProcess)`` of ``helpers.same_run.KILLED_AT_7``, run once per session (one job
    fewer in the suite): rank 1 SIGKILLed at step 7, checkpoints of steps 4 and 6. Read-only for the tests."""
    from helpers.same_run import KILLED_AT_7, run_job

    run = tmp_path_factory.mktemp("killed_at_7") / "run"
    return run, run_job(KILLED_AT_7, run)
