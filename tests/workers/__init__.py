"""Code that runs in processes the tests start, not in the pytest process itself.

Each module holds the functions one test module hands to ``launch_local`` (spawned ranks import
them by name, ``workers.<module>.<function>``, so ``tests/`` is on ``sys.path``: see
``tests/conftest.py``), or a script run in a subprocess with ``python -m workers.<module>``:

- ``state``: process groups of ``DistributedState`` (test_state.py)
- ``comm``: collectives and byte transport over torch and MPI (test_comm.py, test_comm_mpi.py)
- ``strategy``: every aggregation strategy on sharded models (test_strategies.py; reused by
  ``federation`` and ``comm``)
- ``federation``: the federated algorithms against hand computations (test_federation.py)
- ``parallel``: the data-parallel algorithms (test_parallel_dist.py)
- ``train``: gradient accumulation and process-group knobs (test_train_knobs.py)
- ``durability``: the non-finite guard (test_durability.py)
- ``cli_batch``: many ``python -m xffl_like.run`` command lines in one process (test_run.py)
- ``exit_ddp``: a user's Decent-DP script that returns without closing anything (test_exit.py)
- ``exit_launch``: ranks forked from one process with torchrun's environment, for many repetitions (test_exit.py)
"""
