"""Hydra's and OmegaConf's composition errors as the one line shown to the user.

:func:`compose_error` reads the exception Hydra or OmegaConf raised while composing the job's config
(unknown key, wrong type, missing option, unparsable override, a launcher preset without its extra)
and returns one sentence naming the key and the fix, or None for any other error. Hydra reports
some of these only in its message text, which this module parses; nothing else does.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["as_override", "compose_error"]


def _describe(hint: Any) -> str:
    """A schema type in words: ``Optional[int]`` -> 'an integer or null'."""
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint):
        return f"{_describe(args[0] if len(args) == 1 else typing.Union[tuple(args)])} or null"
    if typing.get_origin(hint) is typing.Union:
        return "a number"  # Union[int, float]
    if typing.get_origin(hint) in (list, list):
        return f"a list of {_describe(args[0]).split(' ', 1)[1]}s" if args else "a list"
    if typing.get_origin(hint) in (dict, dict):
        return "a mapping"
    words = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return words.get(hint, "a value")


def as_override(value: Any) -> str:
    """``value`` as a command-line override writes it: null, true, [0.9,0.95]."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if isinstance(value, (list, tuple)):
        return f"[{','.join(as_override(v) for v in value)}]"
    return str(value)


def _quoting_hint(exc: BaseException) -> str:
    """How to quote the override Hydra's lexer refused (a path with spaces, non-ASCII letters or brackets).

    Hydra accepts such a value inside quotes of its own, which the shell must pass through: the
    whole argument in double quotes, the value in single quotes (``"data.path='my file.txt'"``),
    checked with Hydra 1.3 for spaces, accented letters and parentheses.
    """
    override = str(getattr(exc, "override", "") or "")
    key, eq, value = override.partition("=")
    if not eq:  # the shell split a value with spaces: its tail arrived as an override of its own
        return (
            f"{override!r} is not key=value: a value with spaces was split by the shell; quote the whole "
            f"argument and the value, e.g. \"data.path='my file.txt'\"; "
        )
    value = value.strip().strip("'\"")
    return f"quote the value for Hydra and the argument for the shell: \"{key.strip()}='{value}'\"; "


def compose_error(exc: BaseException) -> str | None:
    """One line for an error Hydra or OmegaConf raised while composing the job's config
    (unknown key, wrong type, missing option, unparsable override); None for any other error."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    from .schema import unknown_key_message

    extra = _missing_launcher_extra(exc)
    if extra:
        return extra
    if isinstance(exc, MissingConfigException) and exc.options is not None and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        return (
            f"{group.replace('/', '.')}={option}: no such option (conf/{exc.missing_cfg_file}.yaml); "
            f"available: {', '.join(exc.options)}"
        )
    if isinstance(exc, OverrideParseException):
        return (
            f"cannot parse an override ({str(exc).splitlines()[0]}): "
            f"{_quoting_hint(exc)}see `python -m xffl_like.run --help`"
        )
    cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        return unknown_key_message(cause.full_key)
    if isinstance(cause, ValidationError) and cause.full_key:
        return _wrong_type(cause)
    # A YAML file (an experiment, a group option) with a key or value the schema refuses: Hydra
    # reports "In 'experiment/x': ConfigKeyError raised ...\n<message>\n    full_key: <key>".
    found = re.match(r"In '([^']+)': (\w+) raised while composing config:\n(.*)\n\s*full_key: (\S+)", str(exc))
    if isinstance(exc, HydraException) and found:
        file, kind, message, key = found.groups()
        if kind in ("ConfigKeyError", "ConfigAttributeError"):
            where = "xffl_like/config/schema.py"
            return f"conf/{file}.yaml sets {key}, which is not a config key: check the spelling ({where})"
        return f"conf/{file}.yaml sets {key}: {message.strip()}"
    resolver = re.search(r"\w+ raised while resolving interpolation: (.*)", str(exc))
    if resolver:  # a resolver's ValueError (conf/hydra/launcher's ${xffl.nodes:...}): its own line
        return resolver[1]
    if isinstance(exc, HydraException) or isinstance(cause, OmegaConfBaseException):
        lines = [line.strip() for text in (str(exc), str(cause or "")) for line in text.splitlines()]
        return "; ".join(
            line for line in lines if line and not line.startswith(("full_key", "object_type", "reference_type"))
        )
    return None


def _wrong_type(cause: BaseException) -> str:
    """The line for a value of the wrong type (OmegaConf's ``ValidationError`` against the schema)."""
    import typing
    from dataclasses import MISSING, is_dataclass

    from .schema import section_of

    key = cause.full_key.split("[")[0]
    found = section_of(key)
    if found is None:
        return f"{cause.full_key}={cause.value!r}: {str(cause).splitlines()[0]}"
    cls, field = found
    hint = typing.get_type_hints(cls)[field.name]
    what = _describe(hint) if not is_dataclass(hint) else f"a mapping of {key}.* keys"
    default = field.default
    if default is MISSING and field.default_factory is not MISSING and not is_dataclass(field.default_factory):
        default = field.default_factory()
    example = "" if default in (MISSING, "???") or is_dataclass(hint) else f" (e.g. {key}={as_override(default)})"
    if key != cause.full_key:  # an element of a list
        return f"{cause.full_key}={cause.value!r}: {key} must be {what}{example}"
    return f"{key}={cause.value!r}: must be {what}{', not null' if cause.value is None else ''}{example}"


def _missing_launcher_extra(exc: BaseException) -> str | None:
    """The line for ``hydra/launcher=slurm|local_submitit`` without the ``slurm`` extra: their schemas
    (``hydra_plugins/xffl_like_launcher``) are registered only when hydra-submitit-launcher imports."""
    import importlib.util

    found = re.search(
        r"In 'hydra/launcher/([^']+)': Could not (?:load|find) 'hydra/launcher/xffl_\w+_schema'", str(exc)
    )
    if not found:
        return None
    try:
        plugin = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except (ImportError, ValueError):
        plugin = False
    if plugin:  # the extra is there, xffl_like's own launchers are not: an install of xffl_like without them
        return (
            f"hydra/launcher={found[1]}: hydra_plugins.xffl_like_launcher is not importable; reinstall xffl_like "
            f"(pip install -c constraints.txt -e '.[slurm]')"
        )
    return (
        f"hydra/launcher={found[1]} needs the slurm extra (hydra-submitit-launcher): "
        f"pip install -c constraints.txt -e '.[slurm]'"
    )
