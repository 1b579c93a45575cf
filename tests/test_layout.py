"""The source tree itself: no module shadows the standard library (Prefect puts a flow's folder on sys.path, and
spawned workers inherit it: `flows/inspect.py` once broke every reward worker of a deployed RL run); and the layering
docs/architecture.md states (Layout) holds, checked on the import graph read from the source: every import statement,
those inside functions included (a lazy import is still a dependency), and the registries the config names as
strings (`registered("module:NAME")`, imported when a config is validated)."""

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

TOPS = ("schemas", "storage", "tasks", "flows", "infra")


def test_no_module_or_package_is_named_like_a_standard_library_module():
    names = {p.stem for top in ("flows", "tasks", "schemas", "storage") for p in (ROOT / top).rglob("*.py")}
    names |= {p.name for top in ("flows", "tasks", "schemas", "storage") for p in (ROOT / top).rglob("*") if p.is_dir()}
    assert not (names & set(sys.stdlib_module_names)), sorted(names & set(sys.stdlib_module_names))


@functools.cache
def modules() -> dict[str, Path]:
    out = {}
    for path in (p for top in TOPS for p in (ROOT / top).rglob("*.py") if "test" not in p.parts):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


@functools.cache
def imported_names(module: str) -> frozenset[str]:
    """Every dotted name the module imports (`from a.b import c` gives a.b and a.b.c), relative imports resolved."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set(re.findall(r"registered\(\s*\"([\w.]+):\w+\"", path.read_text()))
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return frozenset(names)


@functools.cache
def graph() -> dict[str, frozenset[str]]:
    """Each module → the package's modules it imports (a name resolves to its longest prefix that is a module)."""

    def target(name: str) -> str | None:
        while name and name not in modules():
            name = name.rpartition(".")[0]
        return name or None

    return {m: frozenset({target(n) for n in imported_names(m)} - {None, m}) for m in modules()}


def reach(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        new = graph()[todo.pop()] - seen
        seen |= new
        todo += new
    return seen


def test_no_import_circle_holds_more_than_three_files():
    """A circle is a set of modules each reachable from every other; a large one means no floor is below another."""
    reachable = {m: reach(m) for m in graph()}
    circles = {frozenset(w for w in reachable[m] if m in reachable[w]) for m in graph() if m in reachable[m]}
    assert sorted(sorted(c) for c in circles if len(c) > 3) == []


def floors() -> list[list[str]]:
    """The floors of docs/architecture.md's "Imports point down" sentence, top first, as module prefixes."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    sentence = re.search(r"Imports point down[^:]*:(.+?)\.\s", text, re.S).group(1)
    return [
        [path.removesuffix("/").removesuffix(".py").replace("/", ".") for path in re.findall(r"`([^`]+)`", floor)]
        for floor in sentence.split("→")
    ]


def floor(module: str) -> int | None:
    for i, prefixes in enumerate(floors()):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def holds_registry(module: str) -> bool:
    return "= Registry(" in modules()[module].read_text()


def test_the_page_places_every_module_that_imports_one():
    """infra/ holds scripts run by hand (the device check), beside the package, not a floor of it."""
    assert len(floors()) >= 5
    unplaced = [m for m, targets in graph().items() if floor(m) is None and targets and not m.startswith("infra")]
    assert unplaced == []


def test_imports_point_down_but_for_the_config_asking_the_registries():
    up = [
        f"{m} -> {t}"
        for m, targets in graph().items()
        for t in targets
        if floor(m) is not None and floor(t) is not None and floor(t) < floor(m)
        and not (m.startswith("schemas.") and holds_registry(t))
    ]  # fmt: skip
    assert up == []


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("tasks.rewards", "tasks.stages"),  # the reward family is called by the stages, never the other way
        ("tasks.stages", "tasks.analysis"),
        ("tasks.engines", "tasks.stages"),  # engine clients never take a stage's context
        ("schemas", "tasks.rewards"),  # the reward modules import the config
        ("schemas", "tasks.stages"),
        ("storage", "tasks"),
    ],
)
def test_what_the_page_says_a_package_does_not_import(importer, imported):
    """Named apart from the floors, so that a change to the page's floors cannot silently drop them."""

    def within(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    found = [
        f"{m} -> {t}" for m, targets in graph().items() if within(m, importer) for t in targets if within(t, imported)
    ]
    assert found == []


def test_prefect_is_imported_by_the_flows_and_the_stages_alone_and_the_flows_import_no_polars_or_torch():
    """No engine worker loads Prefect (the floors keep everything below the stages from importing them)."""
    tops = {m: {name.partition(".")[0] for name in imported_names(m)} for m in modules()}
    prefect = [m for m, names in tops.items() if "prefect" in names and not m.startswith(("flows", "tasks.stages"))]
    assert prefect == []
    assert [m for m, names in tops.items() if m.startswith("flows") and names & {"polars", "torch"}] == []


# The declarations (docs/architecture.md, "Size"): the config, and five files whose docstring says why they are long.
LONG_FILES = {
    "schemas/config.py",
    "schemas/requests.py",
    "schemas/tables.py",
    "tasks/algos/advantages.py",
    "tasks/algos/losses.py",
    "flows/cli.py",
}


def test_no_function_over_80_lines_and_no_file_over_400_but_the_declared_ones():
    long_functions, long_files = [], []
    for module, path in modules().items():
        text = path.read_text()
        if len(text.splitlines()) > 400 and str(path.relative_to(ROOT)) not in LONG_FILES:
            long_files.append(str(path.relative_to(ROOT)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long_functions.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long_functions and not long_files, (long_functions, long_files)
    assert len(LONG_FILES) <= 6
