"""Static contracts over every notebook: they parse, install their stack, take parameters,
and teach with `helpers` instead of copying its logic. nbval executes them (make test-notebooks)."""

import ast
import os
import re
from pathlib import Path

import nbformat
import pytest
from IPython.core.inputtransformer2 import TransformerManager

from helpers.paths import venv_python

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
IDS = [path.name for path in NOTEBOOKS]


def cells(path, kind="code"):
    return [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == kind]


def tagged(path, tag):
    return [cell for cell in cells(path) if tag in cell.metadata.get("tags", [])]


def python_of(cell) -> str:
    return TransformerManager().transform_cell(cell.source)


def test_there_are_notebooks_and_they_are_numbered_in_sequence():
    assert NOTEBOOKS
    assert all(re.match(r"^\d\d_[a-z0-9_]+\.ipynb$", name) for name in IDS), IDS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_code_cell_parses(path):
    for cell in cells(path):
        ast.parse(python_of(cell))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_notebook_installs_the_course_stack_from_requirements_txt_with_one_shared_cell(path):
    install = tagged(path, "install")
    assert len(install) == 1, "one cell tagged 'install'"
    reference = tagged(NOTEBOOKS[0], "install")[0].source
    assert install[0].source == reference, "install cells must be identical across notebooks"
    assert "requirements.txt" in reference and "-e" in reference


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_notebook_has_a_parameters_cell_that_picks_the_model(path):
    parameters = tagged(path, "parameters")
    assert len(parameters) == 1
    assert re.search(r"^MODEL = None", parameters[0].source, re.M)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebooks_define_no_functions_classes_or_lambdas_so_logic_lives_in_helpers(path):
    for cell in cells(path):
        defined = [getattr(node, "name", "lambda") for node in ast.walk(ast.parse(python_of(cell)))
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda))]
        assert defined == [], defined


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebooks_import_helpers_and_never_edit_sys_path(path):
    sources = [cell.source for cell in cells(path)]
    assert any("from helpers import" in s for s in sources)
    assert not any(re.search(r"sys\.path\.(insert|append)", s) for s in sources)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebooks_explain_in_markdown_with_short_code_cells(path):
    markdown, code = cells(path, "markdown"), cells(path)
    assert len(markdown) >= len(code) / 3
    assert max(len(c.source.splitlines()) for c in code if "install" not in c.metadata.get("tags", [])) <= 20


def test_the_install_cell_makes_helpers_importable_in_an_already_running_kernel(tmp_path):
    """What happens on Colab: a kernel without the course runs the install cell, then imports helpers."""
    import shutil
    import subprocess
    import venv

    repo = tmp_path / "course"
    for package in ("helpers", "lab"):  # both packages pyproject installs
        shutil.copytree(ROOT / package, repo / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", repo)
    (repo / "README.md").write_text("course")
    (repo / "requirements.txt").write_text("")  # the stack itself is what CI installs; this checks the mechanism
    (repo / "notebooks").mkdir()
    venv.create(tmp_path / "kernel", with_pip=True)
    python = venv_python(tmp_path / "kernel")
    cell = tagged(NOTEBOOKS[0], "install")[0].source
    script = f"{cell}\nimport helpers, pathlib\nprint(pathlib.Path(helpers.__file__).parent)"
    kernel_env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}  # a fresh kernel sees no clone
    done = subprocess.run([str(python), "-c", script], cwd=repo / "notebooks", capture_output=True, text=True, timeout=300,
                          env=kernel_env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith(str(repo / "helpers"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_notebook_can_simulate_a_learners_card_before_it_loads_anything(path):
    parameters = tagged(path, "parameters")[0].source
    assert re.search(r"^CARD_GB = None", parameters, re.M)
    sources = [cell.source for cell in cells(path)]
    loads = [i for i, s in enumerate(sources) if "load_model(" in s or "from_pretrained(" in s]
    if loads:
        simulated = [i for i, s in enumerate(sources) if "cards.simulate(CARD_GB)" in s]
        assert simulated and simulated[0] < loads[0], "cards.simulate(CARD_GB) must run before the first load"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_a_notebook_that_loads_a_model_ends_by_handing_the_gpu_back(path):
    sources = [cell.source for cell in cells(path)]
    if any("load_model(" in s for s in sources):
        assert "loading.release_gpu()" in sources[-1]


CHOOSING = [path for path in NOTEBOOKS if "planner.choose(" in path.read_text()]
# a card that holds nothing: every planner.choose in the kernel answers "does not run live"
NOTHING_FITS = """
from helpers import planner
planner.choose = lambda step, *args, **kwargs: planner.Choice(
    step, None, None, None, None, f"{planner.STEPS[step].title} does not run live here: the test's card holds nothing.")
"""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_load_of_a_notebook_takes_its_model_from_the_planner_never_a_hard_coded_fallback(path):
    for cell in cells(path):
        for node in ast.walk(ast.parse(python_of(cell))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "load_model":
                source = node.args[0] if node.args else None
                chosen = isinstance(source, ast.Attribute) and source.attr == "model"  # a planner.Choice's model
                assert chosen or ast.unparse(source) == "checkpoint", (path.name, ast.unparse(node))  # 08: the GGUF's own
                keywords = {keyword.arg: ast.unparse(keyword.value) for keyword in node.keywords}
                if chosen and f"{source.value.id}.quant" in keywords.get("quant", ""):  # the choice's own setup, whole:
                    for part in ("ple", "towers", "head"):  # on a 4 GB card the towers and head are part of it
                        assert keywords.get(part) == f"{source.value.id}.{part}", (path.name, part, ast.unparse(node))
    text = path.read_text()
    assert "smaller_sibling(" not in text and "will_load(" not in text  # the planner chooses, with the sibling


@pytest.mark.parametrize("path", CHOOSING, ids=[path.name for path in CHOOSING])
def test_a_notebook_finishes_when_no_step_fits_the_card_and_says_why_for_each_skipped_step(path):
    """Every step skipped, as on a card too small for any of them: no later cell may need a name a skipped step
    would have set, and each step says why it did not run."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    parameters = next(i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", []))
    nb.cells.insert(parameters + 1, nbformat.v4.new_code_cell(NOTHING_FITS))
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    printed = "".join(output.get("text", "") for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs)
    steps = set(re.findall(r'planner\.choose\("([^"]+)"', "\n".join(cell.source for cell in cells(path))))
    assert steps
    for step in steps:
        assert f"{planner_title(step)} does not run live here" in printed, (path.name, step)


def planner_title(step: str) -> str:
    from helpers import planner

    return planner.STEPS[step].title


def record_reads(sources: list) -> list:
    """Where a notebook reads a benchmark record by key: a string subscript or ``.get`` on what a ``records``
    call returned (or a name bound to it, in any cell), other than the ready tables ``records.table`` gives."""
    trees = [ast.parse(source) for source in sources]

    bound: set = set()

    def from_records(node) -> bool:
        """Is this a record: a ``records`` call, or a name bound to one, read through attributes, keys or calls?"""
        while True:
            if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
                node = node.elt
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
                return node.func.value.id == "records" and node.func.attr != "table"
            elif isinstance(node, (ast.Attribute, ast.Subscript)):
                node = node.value
            elif isinstance(node, ast.Call):
                node = node.func
            else:
                return isinstance(node, ast.Name) and node.id in bound

    bindings = [(node.targets[0], node.value) if isinstance(node, ast.Assign) else (node.target, node.iter)
                for tree in trees for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.For, ast.comprehension))]
    while True:  # a name bound from a record, or from a name bound so, is a record too
        more = {t.id for target, value in bindings if from_records(value) for t in ast.walk(target) if isinstance(t, ast.Name)}
        if more <= bound:
            break
        bound |= more

    found = []
    for tree in trees:
        for node in ast.walk(tree):
            keyed = (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)
                     and from_records(node.value))
            got = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                   and from_records(node.func.value))
            if keyed or got:
                found.append(ast.unparse(node))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_no_learner_cell_reads_a_benchmark_record_by_key(path):
    """Record plumbing belongs in helpers.records, which hands a learner ready tables, lines and values."""
    assert record_reads([python_of(cell) for cell in cells(path)]) == []


def test_record_plumbing_in_a_cell_is_found_even_through_a_name_bound_in_another_cell():
    """The control: the forms notebooks 06 and 09 once had."""
    assert record_reads(['bench_records = records.latest_records()',
                         'memory = [r for r in bench_records if r["preset"] == "memory"]']) == ["r['preset']"]
    assert record_reads(['for how, n in records.largest_contexts().get(8, {}).items():\n    print(how, n)']) != []
    assert record_reads(['print(records.table("decode-speed"))', 'run = measure.greedy(m)\nrun["logits"]']) == []
