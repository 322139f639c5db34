"""The helpers package reads one way: imports point down, never in a circle, and none hides in a
function to dodge one; each fact (a card list, a data path) is written in one place."""

import ast
import graphlib
import re
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
MODULES = sorted(path for path in HELPERS.glob("*.py") if path.stem != "__init__")


def relative_imports(tree) -> set:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
    return found


def import_graph() -> dict:
    return {path.stem: relative_imports(ast.parse(path.read_text())) for path in MODULES}


def test_the_helpers_import_graph_has_no_circle():
    graphlib.TopologicalSorter(import_graph()).prepare()  # raises CycleError on a circle


def test_a_circle_between_two_modules_is_detected():
    # the control: the check above must be able to fail
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter({"loading": {"planner"}, "planner": {"loading"}}).prepare()


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_no_helpers_module_imports_a_sibling_inside_a_function_to_dodge_a_circle(path):
    tree = ast.parse(path.read_text())
    hidden = [f"{node.name}: {sorted(relative_imports(node))}" for node in ast.walk(tree)
              if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and relative_imports(node)]
    assert hidden == []


def test_the_package_docstring_maps_every_module():
    import helpers

    mapped = set(re.findall(r"\b([a-z_]+)\b", helpers.__doc__))
    assert {path.stem for path in MODULES} <= mapped


def test_every_import_points_down_the_map_in_the_package_docstring():
    import helpers

    rank = {}
    for line in helpers.__doc__.splitlines():
        if line.startswith("    ") and line.strip():
            names = re.split(r"\s{2,}", line.strip())[0]
            rank.update({name.strip(): len(rank) for name in names.split(",")})
    for module, imported in import_graph().items():
        for target in imported:
            assert rank[target] <= rank[module], f"{module} imports {target}, which the map lists below it"


@pytest.mark.parametrize("fact", [r"\b8, 15, 16\b", r'"data" / "', r"parents\[1\]", r'"gpu-tier"'])
def test_each_fact_is_spelled_in_one_helpers_module(fact):
    holders = [path.name for path in MODULES if re.search(fact, path.read_text())]
    assert len(holders) <= 1, holders
