"""Tier 1: the package's structure -- no import cycle between xffl_like's modules; short functions where the
trainer meets the federation.

Every ``import`` and ``from ... import`` of every module (function-level ones too, read with
``ast``) is an edge to the xffl_like module it names (``from . import codec`` names the
submodule, not the package); a strongly connected component of more than one module is a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO


def module_graph(package: Path) -> dict[str, set[str]]:
    """Module name -> the xffl_like modules it imports."""
    modules: dict[str, tuple[Path, list[str]]] = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
            home = parts
        else:
            home = parts[:-1]
        modules[".".join(parts)] = (path, home)
    graph: dict[str, set[str]] = {}
    for name, (path, home) in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = home[: len(home) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                names = submodules or [target]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            edges.update(n for n in names if n in modules and n != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_planted_cycle(tmp_path):
    pkg = tmp_path / "xffl_like"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from .b import g\n")  # function-level
    (pkg / "sub" / "b.py").write_text("from xffl_like.sub.a import f\n")
    (pkg / "c.py").write_text("from .sub import a\n")
    assert cycles(module_graph(pkg)) == [["xffl_like.sub.a", "xffl_like.sub.b"]]


def test_no_import_cycle_in_the_package():
    graph = module_graph(REPO / "xffl_like")
    assert "xffl_like.federation.federation" in graph and len(graph) > 50
    assert cycles(graph) == []


def test_console_scripts_name_callables():
    """Every ``[project.scripts]`` entry of pyproject.toml names a function that exists."""
    import importlib

    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"xffl-run", "xffl-prepare", "xffl-bench"} <= set(scripts)
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), (name, target)


def test_functions_in_the_package_are_short():
    """Issues 27 and 36: no function in the package over 60 lines, 80 in ``bench/`` (the code stays readable)."""
    package = REPO / "xffl_like"
    long = []
    for path in sorted(package.rglob("*.py")):
        limit = 80 if "bench" in path.relative_to(package).parts else 60
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    long.append(f"{path.relative_to(package)}:{node.name}:{lines}")
    assert not long, long


def test_the_hub_server_and_client_share_only_the_protocol():
    """hub.protocol imports neither end; hub.server and hub.client do not import each other; federation/ imports
    nothing of the hub's server."""
    graph = module_graph(REPO / "xffl_like")
    server = {m for m in graph if m == "xffl_like.hub.server" or m.startswith("xffl_like.hub.server.")}
    client = {m for m in graph if m == "xffl_like.hub.client"}
    assert server and client and "xffl_like.hub.protocol.messages" in graph
    bad = []
    for module, edges in graph.items():
        if module.startswith("xffl_like.hub.protocol"):
            bad += [f"{module} -> {e}" for e in edges & (server | client)]
        if module in server:
            bad += [f"{module} -> {e}" for e in edges & client]
        if module in client:
            bad += [f"{module} -> {e}" for e in edges & server]
        if module == "xffl_like.federation" or module.startswith("xffl_like.federation."):
            bad += [f"{module} -> {e}" for e in edges & server]
    assert not bad, bad


#: The package's layers (docs/architecture.md, "Layers"): each unit and the units it may import. A unit is a
#: package, except where a package's parts sit in different layers (config's core and its launch-time checks;
#: the hub's protocol, server, client and tools; the elastic federation).
LAYERS: dict[str, set[str]] = {
    "config": set(),
    "comm": {"config"},
    "data": {"config"},
    "distributed": {"config", "comm"},
    "models": {"config", "distributed"},
    "aggregation": {"config", "comm", "distributed"},
    "parallel": {"config", "config.context", "comm", "distributed", "models"},
    "observe": {"config", "federation"},
    "checkpoint": {"config", "data", "distributed", "models", "observe"},
    "federation": {"config", "aggregation", "checkpoint", "distributed", "parallel"},
    "hub.protocol": {"config", "federation", "models", "parallel"},
    "hub.server": {"config", "federation", "hub", "hub.protocol"},
    "hub.client": {"hub.protocol"},
    "hub": {"config", "hub.protocol", "hub.server"},
    "federation.elastic": {"config", "distributed", "federation", "hub", "hub.protocol"},
    "train": {
        "config",
        "aggregation",
        "checkpoint",
        "data",
        "distributed",
        "federation",
        "federation.elastic",
        "hub.client",
        "models",
        "observe",
        "parallel",
        "config.plan",
    },
    "config.context": {"config", "distributed", "federation", "models"},  # its types, under TYPE_CHECKING
    "config.plan": {"config", "distributed", "federation"},
    "config.launch": {
        "config.context",
        "config.plan",
        "aggregation",
        "checkpoint",
        "config",
        "data",
        "distributed",
        "federation",
        "federation.elastic",
        "models",
        "observe",
        "parallel",
    },
    "job": {
        "xffl_like",
        "config",
        "config.launch",
        "config.plan",
        "checkpoint",
        "distributed",
        "federation.elastic",
        "hub.client",
        "parallel",
        "train",
    },
    "run": {"xffl_like", "config", "config.launch", "distributed", "job"},
    "bench": {"*"},
    "xffl_like": {"config"},
}


def layer_unit(module: str) -> str:
    """The unit of :data:`LAYERS` that ``module`` (a dotted name under xffl_like) belongs to."""
    parts = module.split(".")[1:]
    if not parts:
        return "xffl_like"
    if parts[0] == "config" and parts[1:2] and parts[1] in ("validate", "hydra_errors"):
        return "config.launch"
    if parts[0] == "config" and parts[1:2] and parts[1] in ("plan", "context"):
        return f"config.{parts[1]}"
    if parts[0] == "hub" and parts[1:2] and parts[1] in ("protocol", "server", "client"):
        return f"hub.{parts[1]}"
    if parts[:2] == ["federation", "elastic"]:
        return "federation.elastic"
    return parts[0]


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, edges in sorted(graph.items()):
        unit = layer_unit(module)
        allowed = LAYERS[unit]
        for target in sorted(edges):
            other = layer_unit(target)
            if other != unit and "*" not in allowed and other not in allowed:
                bad.append(f"{module} -> {target} ({unit} may not import {other})")
    return bad


def test_layer_checker_finds_a_planted_upward_import(tmp_path):
    pkg = tmp_path / "xffl_like"
    for sub in ("config", "train", "models"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "llama.py").write_text("def f():\n    from ..train import loop\n")
    (pkg / "train" / "loop.py").write_text("from ..models import llama\n")
    assert layer_violations(module_graph(pkg)) == [
        "xffl_like.models.llama -> xffl_like.train.loop (models may not import train)"
    ]


def test_every_module_imports_only_its_layers():
    """Issue 36 item 6: the map of docs/architecture.md holds; every unit of the package is in it."""
    graph = module_graph(REPO / "xffl_like")
    assert {layer_unit(m) for m in graph} <= set(LAYERS), {layer_unit(m) for m in graph} - set(LAYERS)
    assert layer_violations(graph) == []
