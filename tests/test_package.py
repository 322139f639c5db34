"""The helpers package reads one way: imports point down, never in a circle, and none hides in a
function to dodge one; each fact (a card list, a data path) is written in one place. What the notebooks
teach is ``helpers``; the lab's equipment is ``lab``, which imports helpers and which no notebook imports."""

import ast
import graphlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "helpers"
MODULES = sorted(path for path in HELPERS.glob("*.py") if path.stem != "__init__")
LAB_MODULES = sorted((ROOT / "lab").glob("*.py"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


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

    mapped = set(re.findall(r"\b([a-z_][a-z_0-9]*)\b", helpers.__doc__))
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


def imported_packages(tree) -> set:
    """The top-level packages a module's absolute imports name (``from lab import bench`` -> lab)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def notebook_code(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


def test_the_equipment_package_is_not_empty_and_notebooks_exist():
    # the checks below pass vacuously on an empty list
    assert len(LAB_MODULES) >= 4 and len(NOTEBOOKS) >= 10


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_notebook_imports_the_lab_equipment(path):
    code = "\n".join(line for line in notebook_code(path).splitlines() if not line.lstrip().startswith(("%", "!")))
    assert "lab" not in imported_packages(ast.parse(code))


def test_a_notebook_that_imports_the_lab_is_caught():
    # the control: the scan above must see an import of lab, in either spelling
    assert "lab" in imported_packages(ast.parse("from lab import bench\nimport lab.measure"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_helpers_never_imports_the_lab_equipment(path):
    assert "lab" not in imported_packages(ast.parse(path.read_text()))


@pytest.mark.parametrize("path", LAB_MODULES, ids=lambda p: p.name)
def test_the_lab_reaches_helpers_by_its_name_not_as_a_sibling(path):
    # a relative import in lab can only mean lab itself; helpers is named in full
    tree = ast.parse(path.read_text())
    assert relative_imports(tree) <= {p.stem for p in LAB_MODULES}


def modules_after_import(module: str) -> set:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    return set(done.stdout.split())


def test_importing_loading_imports_neither_the_synthetic_builder_nor_the_download_machinery():
    imported = modules_after_import("helpers.loading")
    assert "helpers.loading" in imported
    assert not {"helpers.synthetic", "helpers.download", "helpers.checksums"} & imported


def test_the_import_check_sees_the_builder_where_it_is_imported():
    # the control: the same subprocess check reports the builder and the downloader when they are imported
    imported = modules_after_import("helpers.synthetic, helpers.download")
    assert {"helpers.synthetic", "helpers.download"} <= imported
