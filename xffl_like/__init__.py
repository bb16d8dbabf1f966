"""xffl_like: federated LLM training across HPC facilities."""

from pathlib import Path

from .config.schema import register as _register

#: Hydra's config directory: package data of xffl_like (pyproject's package-data), found the same from an
#: installed wheel as from a checkout (whose ./conf links here).
CONF_DIR = Path(__file__).resolve().parent / "conf"

_register()  # the job's config schema, before anyone composes conf/config.yaml
