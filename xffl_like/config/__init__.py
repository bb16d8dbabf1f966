"""The job's configuration, in one package: what a user may write and how it is checked, before any worker starts.

- :mod:`.schema`: the typed sections (one frozen dataclass each) assembled in ``JobConfig``; Hydra's schema.
- :mod:`.errors`: :class:`~.errors.ConfigError`, the one exception of a config problem (one line for the user).
- :mod:`.checks`: type predicates for config values (``is_int``, ``is_number``, ``not_regular``).
- :mod:`.context`: :class:`~.context.ValidationContext`, what a check takes besides the job.
- :mod:`.validate`: :func:`~.validate.validate_config`, the one walk of every check, and ``normalise``.
- :mod:`.hydra_errors`: Hydra's composition report as one line.
- :mod:`.plan`: :class:`~.plan.WorkerPlan`, what the launcher planned, handed to every worker.

The package imports none of its modules here: a section's owner (``federation.options``, ``data``, ...)
imports ``config.errors`` or ``config.schema`` without pulling in the validation that imports it back.
"""
