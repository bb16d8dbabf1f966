"""docs/config.md stays in sync with conf/: every key of every YAML file, every option, the defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from helpers import REPO as ROOT

CONF = ROOT / "conf"
DOCS = ROOT / "docs"
ROOT_CONFIGS = ("config.yaml", "bench.yaml", "bench_wan.yaml")


def _flatten(node: dict, prefix: str = ""):
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _keys(path: Path) -> dict:
    """Dotted key -> value, as a user overrides it (group files are prefixed with their group)."""
    text = path.read_text()
    data = yaml.safe_load(text) or {}
    global_package = path.parent == CONF or "# @package _global_" in text
    package = re.search(r"^# @package ([\w.]+)$", text, re.M)  # e.g. federation/topk's "# @package federation"
    prefix = (
        "" if global_package else f"{package[1]}." if package else ".".join(path.parent.relative_to(CONF).parts) + "."
    )  # hydra/launcher -> hydra.launcher.
    return {f"{prefix}{k}" if k != "defaults" else k: v for k, v in _flatten(data)}


def _default_cells() -> dict[str, list[str]]:
    """Key -> the default cells of every table row of docs/config.md that documents it."""
    rows: dict[str, list[str]] = {}
    for line in (DOCS / "config.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 3 and re.fullmatch(r"`[^`]+`", cells[0]):
            rows.setdefault(cells[0].strip("`"), []).append(cells[1])
    return rows


YAMLS = sorted(CONF.rglob("*.yaml"))


@pytest.mark.parametrize("path", YAMLS, ids=[str(p.relative_to(CONF)) for p in YAMLS])
def test_every_key_and_option_is_documented(path):
    doc = (DOCS / "config.md").read_text()
    missing = [key for key in _keys(path) if f"`{key}`" not in doc]
    assert not missing, f"{path.relative_to(ROOT)}: keys missing from docs/config.md: {missing}"
    if path.parent != CONF:
        option = f"{path.parent.relative_to(CONF).as_posix()}={path.stem}"
        assert option in doc, f"option {option} missing from docs/config.md"


def _documented_defaults():
    defaults = yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
    files = [CONF / name for name in ROOT_CONFIGS if (CONF / name).exists()]
    files += [
        CONF / group / f"{option}.yaml"
        for entry in defaults
        if isinstance(entry, dict)
        for group, option in entry.items()
        if (CONF / group).is_dir() and option is not None
    ]  # not Hydra's own groups
    return files


@pytest.mark.parametrize("path", _documented_defaults(), ids=lambda p: str(p.relative_to(CONF)))
def test_documented_defaults_match_the_files(path):
    cells = _default_cells()
    for key, value in _keys(path).items():
        if key == "defaults":
            continue
        parsed = [yaml.safe_load(c.strip("`")) for c in cells.get(key, []) if re.fullmatch(r"`[^`]*`", c)]
        assert value in parsed, f"{key}: the file says {value!r}, docs/config.md says {cells.get(key)}"


def test_relative_links_resolve():
    for page in DOCS.rglob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"
