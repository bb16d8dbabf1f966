"""Unknown keys: every key of the composed config must be one that a selected YAML file defines.

Hydra's struct mode already rejects ``train.nonsense=1``, but ``+key=value`` (and ``++``) is
Hydra's way to add a key, and an experiment file may add any key: both would reach the
workers unread. :func:`check_known_keys` compares the composed tree with the union of the
keys of ``conf/config.yaml`` and of the option chosen in every group (a file with
``# @package _global_`` contributes at the root), and names the first stranger.
A key whose file value is a scalar or null accepts any value, a mapping included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import yaml

__all__ = ["allowed_keys", "check_known_keys"]


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        elif isinstance(value, dict) or key not in into:
            into[key] = value


def _load(path: Path) -> tuple[dict, bool]:
    text = path.read_text()
    data = yaml.safe_load(text) or {}
    data.pop("defaults", None)
    return data, any(line.strip().replace(" ", "") == "#@package_global_" for line in text.splitlines()[:5])


def allowed_keys(choices: Mapping[str, Any], conf_dir: Path) -> dict:
    """The key tree the composition may have: the root file plus each chosen group option."""
    tree, _ = _load(conf_dir / "config.yaml")
    tree.pop("hydra", None)
    for group, option in choices.items():
        if option is None or group.split("/")[0] == "hydra":
            continue
        path = conf_dir / group / f"{option}.yaml"
        if not path.exists():
            continue
        data, global_package = _load(path)
        data.pop("hydra", None)
        if not global_package:
            for part in reversed(group.split("/")):
                data = {part: data}
        _merge(tree, data)
    return tree


def check_known_keys(cfg: Mapping[str, Any], choices: Mapping[str, Any], conf_dir: Path) -> None:
    """Raise ``ValueError`` (one line) for the first key of ``cfg`` that no selected file defines."""
    allowed = allowed_keys(choices, conf_dir)

    def walk(node: Mapping, known: Mapping, prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if key not in known:
                top = dotted.split(".")[0]
                where = (f"{top}={choices[top]} (conf/{top}/{choices[top]}.yaml)" if top in choices and top != dotted
                         else "the root config")
                raise ValueError(f"{dotted} is not a config key of {where}: check the spelling, or drop the "
                                 f"override (`+` adds keys; `--cfg job` prints the composed config)")
            if isinstance(value, Mapping) and isinstance(known[key], dict) and known[key]:
                walk(value, known[key], f"{dotted}.")

    walk({k: v for k, v in cfg.items() if k != "hydra"}, allowed, "")
