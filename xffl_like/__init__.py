"""xffl_like: federated LLM training across HPC facilities."""

from .schema import register as _register

_register()  # the job's config schema, before anyone composes conf/config.yaml
