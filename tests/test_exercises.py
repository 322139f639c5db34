"""Every exercise's checker says Correct to the worked solution in solutions/ and Not yet to a wrong answer, and
never gives the answer away on a wrong one; every notebook ends with two or three exercises wired to it."""

import importlib.util
import inspect
import re
from pathlib import Path

import nbformat
import pytest
import torch

from helpers import exercises

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KEYS = sorted(exercises.EXERCISES)
# a plausible mistake for each: the answer a learner who half-understood would give
WRONG = {
    "00.1": "HF_HOME", "00.2": True, "01.1": {"HF_ENDPOINT"}, "01.2": None, "02.1": 0.5, "02.2": torch.bfloat16,
    "03.1": {"vision_tower": "cpu", "": 0}, "03.2": "model", "04.1": "model.language_model.layers.0.mlp.down_proj",
    "04.2": "model.language_model.embed_tokens", "05.1": 2.0, "05.2": 262144 * 2, "06.1": 3.88, "06.2": 40000,
    "07.1": [{"role": "user", "content": "Hello"}], "07.2": "<eos>", "08.1": "Q8_0", "08.2": "gemma3",
    "09.1": 0.0, "09.2": 0.5, "10.1": 8 * 2560 * 2, "10.2": "optimizer state (paged_adamw_8bit)",
}


def solution(key: str):
    number = key.split(".")[0]
    [path] = (ROOT / "solutions").glob(f"s{number}_*.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, f"answer_{key.replace('.', '_')}")


def context_for(key: str) -> dict:
    return {"source": "tiny"} if "source" in inspect.signature(exercises.EXERCISES[key].checker).parameters else {}


def test_every_exercise_has_a_wrong_answer_to_be_checked_against():
    assert set(WRONG) == set(KEYS)


@pytest.mark.parametrize("key", KEYS)
def test_the_worked_solution_is_correct(key, tiny_path):
    function = solution(key)
    answer = function(**context_for(key)) if inspect.signature(function).parameters else function()
    verdict = exercises.check(key, answer, **context_for(key))
    assert verdict.correct is True, str(verdict)


@pytest.mark.parametrize("key", KEYS)
def test_a_wrong_answer_is_not_yet_and_gets_a_hint_not_the_answer(key, tiny_path):
    wrong = WRONG[key]
    if wrong is None:  # 01.2's trap is token=None, which sends the saved token; None itself means unanswered
        wrong = "None"
    verdict = exercises.check(key, wrong, **context_for(key))
    assert verdict.correct is False, str(verdict)
    assert "Hint:" in verdict.message


def test_an_unanswered_exercise_says_so_and_an_unknown_one_is_refused():
    assert exercises.check("04.1", None).correct is None
    with pytest.raises(exercises.InvalidChoiceError, match="04.1"):
        exercises.check("04.9", "x")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_notebook_ends_with_two_or_three_exercises_wired_to_the_checker(path):
    cells = nbformat.read(path, as_version=4).cells
    number = path.name[:2]
    checked = [m for cell in cells if cell.cell_type == "code" for m in re.findall(r'exercises\.check\("(\d\d\.\d)"', cell.source)]
    assert 2 <= len(checked) <= 3 and all(key.startswith(number) for key in checked), checked
    assert sorted(checked) == [key for key in KEYS if key.startswith(number)]
    first = next(i for i, cell in enumerate(cells) if cell.cell_type == "markdown" and cell.source.startswith("## Exercises"))
    later_code = [cell for cell in cells[first:] if cell.cell_type == "code"]
    assert all("exercises.check(" in c.source or "answer" in c.source or "release_gpu" in c.source for c in later_code)


def test_an_exercise_that_needs_no_model_accepts_the_source_keyword_the_docstring_shows():
    from helpers import paths

    assert exercises.check("00.1", paths.CACHE_ENV, source="tiny").correct is True
    assert exercises.check("00.1", "HF_HOME", source="tiny").correct is False  # the control: a wrong answer still fails


def test_a_misspelt_keyword_is_refused_not_ignored():
    from helpers.errors import InvalidChoiceError

    with pytest.raises(InvalidChoiceError, match="source=MODEL_NAME"):
        exercises.check("04.1", 1.0, sorce="tiny")


def test_a_numeric_answer_computed_as_a_0d_tensor_is_read_as_its_number():
    from helpers import planner

    expected = planner.predict("e4b-shape", "nf4", "cpu", 16384).peak_bytes / 1e9
    assert exercises.check("06.1", torch.tensor(expected)).correct is True
    assert exercises.check("06.1", torch.tensor(expected * 2)).correct is False  # the control: a wrong number fails
    assert exercises.check("06.1", torch.tensor(True)).correct is False  # a bool is not a number
    assert exercises.check("06.1", torch.tensor([expected, expected])).correct is False  # nor are two
