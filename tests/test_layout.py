"""The tree keeps the shape the documents give it (docs/architecture.md, "The house").

- No import circle among the modules of ``ledger``, ``router`` and ``otel``: every import
  counts, at the top of a module or inside a function (a deferred import is a dependency all
  the same), and an import of ``a.b.c`` is an import of that module, not of ``a`` or ``a.b``.
- Imports point down the layers: each rule of :data:`RULES` names what a package must never
  import; each import :data:`ALLOWED` across them says why, and must still be made.
- The layout table of contract §1 names only folders and modules that exist, and every
  package and module at the top of ``ledger/`` and ``router/``; README.md and docs/ name only
  paths and modules that exist.

The graph is read from the source with ``ast``, nothing is imported.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parent.parent
PACKAGES: Final = ("ledger", "router", "otel")

Graph = Mapping[str, Mapping[str, int]]
"""Module name -> the modules it imports -> the line of the first such import."""


# --- the import graph ---


def modules_of(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name (a package by its own)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, dict[str, int]]:
    modules = modules_of(root, packages)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _imports(name: str, path: Path, modules: Mapping[str, Path]) -> dict[str, int]:
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, here)
            # `from a.b import c` imports the module a.b.c when there is one, else a name of a.b.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            module = _module_of(target, modules)
            if module is not None and module != name:
                edges.setdefault(module, node.lineno)
    return edges


def _absolute(node: ast.ImportFrom, here: str) -> str:
    if not node.level:
        return node.module or ""
    package = here
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _module_of(target: str, modules: Mapping[str, Path]) -> str | None:
    """The module of ours that ``target`` names, or None for another library's."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def circles(graph: Graph) -> list[list[str]]:
    """One circle through each group of modules that import one another, directly or not
    (Tarjan's strongly connected components), as the modules in import order, the first
    repeated at the end."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = set(stack[stack.index(module) :])
            del stack[stack.index(module) :]
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [_circle_in(graph, group) for group in groups]


def _circle_in(graph: Graph, group: set[str]) -> list[str]:
    """The shortest way from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for successor in sorted(graph[module]):
                if successor == start:
                    return [*paths[module], start]
                if successor in group and successor not in paths:
                    paths[successor] = [*paths[module], successor]
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no circle through {start}")  # a strongly connected group has one


def describe(graph: Graph, circle: list[str]) -> str:
    return " -> ".join([circle[0]] + [f"{b} (line {graph[a][b]})" for a, b in pairwise(circle)])


# --- the rules ---


@dataclass(frozen=True, slots=True)
class Rule:
    """The modules of ``importers`` (but ``exempt``) import nothing of ``never`` (but
    ``unless``)."""

    importers: tuple[str, ...]
    never: tuple[str, ...]
    why: str
    exempt: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()

    def broken_by(self, graph: Graph) -> list[str]:
        return sorted(
            f"{importer} imports {imported} (line {line})"
            for importer, imports in graph.items()
            if _in(importer, self.importers) and not _in(importer, self.exempt)
            for imported, line in imports.items()
            if _in(imported, self.never)
            and not _in(imported, self.unless)
            and not any(_in(importer, (a.importer,)) and imported == a.imported for a in ALLOWED)
        )


@dataclass(frozen=True, slots=True)
class Allowed:
    """The modules of ``importer`` may import the module ``imported``, whatever the rules."""

    importer: str
    imported: str
    why: str


def _in(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


_EDGES: Final = ("router.http", "router.cli", "router.serving")

RULES: Final = {
    "ledger": Rule(
        ("ledger",), ("router", "otel"), "the ledger knows nothing of routing, HTTP or OTel"
    ),
    "otel": Rule(("otel",), ("router",), "traces and metrics are derived from ledger events"),
    "request": Rule(
        ("router.request",),
        ("router.doors", *_EDGES, "router.fake_provider"),
        "the request core is called by doors and edges, never the reverse",
    ),
    "drivers and adapters": Rule(
        ("router.drivers", "router.adapters"),
        ("router.request", "router.doors", *_EDGES),
        "drivers and adapters serve the request core: they know neither it nor the edges",
    ),
    "doors": Rule(("router.doors",), _EDGES, "a door translates; the edges mount it"),
    "http": Rule(("router.http",), ("router.cli",), "the app never reaches into the CLI"),
    "fake provider": Rule(
        PACKAGES,
        ("router.fake_provider",),
        "the fake provider is the tests' and the demo's, never the product's",
        exempt=("router.fake_provider", "router.cli.demo", "router.cli.fake_provider"),
    ),
    "support": Rule(
        ("ledger.support", "router.support"),
        PACKAGES,
        "support modules are generic: they import no domain module",
        unless=("ledger.support", "router.support"),
    ),
}
"""The layers of docs/architecture.md "The house", each as what it must never import."""

ALLOWED: Final = (
    Allowed(
        "router.drivers",
        "router.request.classify",
        "the failure classifier: its vocabulary (UpstreamOutcome, Transport, Classification) "
        "and classify(), with which a driver reports what it observed in the core's terms",
    ),
    Allowed(
        "router.adapters.breaker_policy",
        "router.request.classify",
        "MAX_RETRY_AFTER_MS, the classifier's bound on a Retry-After, caps a breaker's wait",
    ),
    Allowed(
        "router.adapters.provider_reports",
        "router.request.worst_case",
        "settlement_rates: a provider report's usage is priced at the rates the core settles at",
    ),
)
"""Imports of the request core's shared vocabulary from below it, kept on purpose until it
has a home of its own."""


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, int]]:
    return import_graph(ROOT, PACKAGES)


def test_no_module_of_ledger_router_or_otel_imports_itself_around_a_circle(
    graph: Graph,
) -> None:
    found = [describe(graph, circle) for circle in circles(graph)]
    assert not found, "import circles:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "rule",
    [pytest.param(rule, id=name) for name, rule in RULES.items()],
)
def test_imports_point_down_the_layers(graph: Graph, rule: Rule) -> None:
    broken = rule.broken_by(graph)
    assert not broken, f"{rule.why}:\n" + "\n".join(broken)


@pytest.mark.parametrize("allowed", ALLOWED, ids=lambda a: f"{a.importer}>{a.imported}")
def test_each_import_allowed_across_the_layers_is_still_made(
    graph: Graph, allowed: Allowed
) -> None:
    # An allowance nothing uses any more is a door left open: remove it.
    assert any(
        _in(importer, (allowed.importer,)) and allowed.imported in imports
        for importer, imports in graph.items()
    )


# The analysis itself, on small trees: a check that cannot fail proves nothing.


def _tree(root: Path, files: Mapping[str, str]) -> dict[str, dict[str, int]]:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return import_graph(root, ["pkg"])


def test_a_deferred_import_closes_a_circle(tmp_path: Path) -> None:
    graph = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import B\n",
            "pkg/b.py": "def f():\n    from pkg import a\n",
        },
    )
    assert [describe(graph, c) for c in circles(graph)] == [
        "pkg.a -> pkg.b (line 1) -> pkg.a (line 2)"
    ]


def test_importing_a_submodule_is_not_importing_its_package(tmp_path: Path) -> None:
    graph = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.sub import helper\n",
            "pkg/sub/__init__.py": "from . import helper\n",
            "pkg/sub/helper.py": "import pkg.sub.other\nfrom .. import sibling\n",
            "pkg/sub/other.py": "import json\n",
            "pkg/sibling.py": "from pkg.sub.other import x\n",
        },
    )
    assert graph["pkg.sub.helper"] == {"pkg.sub.other": 1, "pkg.sibling": 2}
    assert graph["pkg.sub"] == {"pkg.sub.helper": 1}
    assert circles(graph) == []


def test_a_rule_names_each_import_it_refuses(tmp_path: Path) -> None:
    graph = _tree(
        tmp_path,
        {"pkg/__init__.py": "", "pkg/low.py": "def f():\n    import pkg.high\n", "pkg/high.py": ""},
    )
    rule = Rule(("pkg.low",), ("pkg.high",), "down only")
    assert rule.broken_by(graph) == ["pkg.low imports pkg.high (line 2)"]
    assert Rule(("pkg.high",), ("pkg.low",), "down only").broken_by(graph) == []


# --- the layout, as the documents give it ---

_QUOTED: Final = re.compile(r"`([^`\n]+)`")
_FENCED: Final = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_PATH: Final = re.compile(r"^[\w.-]+(?:/[\w.-]*)*$")


def layout_table(contract: str) -> list[tuple[list[str], list[str]]]:
    """Contract §1 "Repository": each row's paths (its first cell) and the files and
    folders its second cell names, relative to the row's folder."""
    section = re.search(r"^### Repository\n(.*?)(?=^#)", contract, re.MULTILINE | re.DOTALL)
    assert section, "contract §1 has no Repository table"
    rows = []
    for line in section.group(1).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or set(cells[0]) <= {"-"}:
            continue
        if cells[0] == "path":
            continue
        named = [n for n in _QUOTED.findall(cells[1]) if n.endswith((".py", "/"))]
        rows.append((_QUOTED.findall(cells[0]), named))
    assert rows, "contract §1's Repository table has no rows"
    return rows


CONTRACT: Final = (ROOT / "docs" / "contract.md").read_text()


def test_the_layout_table_names_what_exists() -> None:
    missing = []
    for paths, named in layout_table(CONTRACT):
        missing += [path for path in paths if not (ROOT / path).exists()]
        folders = [path for path in paths if path.endswith("/")]
        for name in named:
            # A module a row names lives in the row's folder (or is a path from the root).
            places = [ROOT / folder / name for folder in folders] + [ROOT / name]
            if not any(place.exists() for place in places):
                missing.append(f"{name} (in {', '.join(paths)})")
    assert not missing, "contract §1's layout table names what does not exist: " + ", ".join(
        missing
    )


def test_the_layout_table_names_every_package_and_module_of_ledger_and_router() -> None:
    listed = {path.rstrip("/") for paths, _ in layout_table(CONTRACT) for path in paths}
    tops = {
        f"{package}/{child.name}"
        for package in ("ledger", "router")
        for child in (ROOT / package).iterdir()
        if (child / "__init__.py").exists() or (child.suffix == ".py" and child.stem != "__init__")
    }
    assert not tops - listed, "missing from contract §1's layout table: " + ", ".join(
        sorted(tops - listed)
    )


_DOCUMENTS: Final = ("README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))))
_TREES: Final = (*PACKAGES, "alembic", "tests", "bench", "scripts", "docs")
_DOTTED: Final = re.compile(r"^(?:ledger|router|otel)(?:\.\w+)+(?:\(\))?$")


def _named_in(document: str) -> Iterable[str]:
    for quoted in _QUOTED.findall(_FENCED.sub("", (ROOT / document).read_text())):
        name = quoted.split("::")[0].split(" ")[0]
        if _PATH.match(name) and name.split("/")[0] in _TREES and "/" in name:
            yield name
        elif _DOTTED.match(name):
            yield name.removesuffix("()")


_ONLY_IN_THE_WHEEL: Final = frozenset({"ledger.migrations"})  # alembic/, packed (pyproject.toml)


def _exists(name: str, modules: Mapping[str, Path]) -> bool:
    if name in _ONLY_IN_THE_WHEEL:
        return True
    if "/" in name:
        return (ROOT / name).exists()
    module = _module_of(name, modules)
    if module is None:
        return False
    rest = name[len(module) + 1 :].split(".")[0]
    return not rest or re.search(rf"\b{re.escape(rest)}\b", modules[module].read_text()) is not None


@pytest.mark.parametrize("document", _DOCUMENTS)
def test_the_documents_name_only_paths_and_modules_that_exist(document: str) -> None:
    modules = modules_of(ROOT, PACKAGES)
    stale = sorted({name for name in _named_in(document) if not _exists(name, modules)})
    assert not stale, f"{document} names what the tree does not hold: " + ", ".join(stale)
