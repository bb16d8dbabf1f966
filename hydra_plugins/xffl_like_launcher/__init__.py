"""xffl_like's Hydra launchers: sweep points as their own jobs (``hydra/launcher=slurm`` or
``local_submitit``, presets in ``conf/hydra/launcher/``). Hydra finds launchers only under the
``hydra_plugins`` package; the code is in ``_submitit_sweep`` (a leading ``_``: Hydra's plugin scan
does not import it by itself, so that without the ``slurm`` extra nothing warns)."""

try:
    import hydra_plugins.hydra_submitit_launcher  # noqa: F401 - the slurm extra
except ImportError:  # the presets then fail to compose and xffl_like.config.validate names the extra
    pass
else:
    from ._submitit_sweep import LocalSweepLauncher, SlurmSweepLauncher  # noqa: F401
