"""docs/troubleshooting.md: every course error links to a heading that exists, each error class has an entry of its
own, the page holds the seed article's eight pitfalls and the exact commands the setup check prints (one fact,
two places, checked equal)."""

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import helpers
from helpers import course, environment, links
from helpers.errors import CourseError

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / links.TROUBLESHOOTING_PAGE


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set:
    seen, found = {}, set()
    for line in text.splitlines():
        match = re.match(r"^#{1,6} (.+)$", line)
        if match:
            anchor = github_anchor(match.group(1))
            found.add(anchor if anchor not in seen else f"{anchor}-{seen[anchor]}")
            seen[anchor] = seen.get(anchor, 0) + 1
    return found


def course_error_classes() -> list:
    for module in pkgutil.iter_modules(helpers.__path__):
        importlib.import_module(f"helpers.{module.name}")
    found, todo = [], [CourseError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return sorted(set(found), key=lambda c: c.__qualname__)


def dead_entries(classes, text: str) -> list:
    known = anchors(text)
    return [f"{cls.__qualname__}: #{cls.entry}" for cls in classes if cls.entry not in known]


def test_every_course_error_links_to_a_heading_that_exists():
    assert dead_entries(course_error_classes(), PAGE.read_text()) == []


def test_a_link_to_a_heading_that_does_not_exist_is_reported():
    """The control: a dead link is caught."""
    dead = type("DeadLinkError", (CourseError,), {"entry": "no-such-heading"})
    assert dead_entries([dead], PAGE.read_text()) == ["DeadLinkError: #no-such-heading"]


@pytest.mark.parametrize("cls", [c for c in course_error_classes() if c is not CourseError], ids=lambda c: c.__qualname__)
def test_every_error_class_has_an_entry_of_its_own_and_its_message_carries_the_link(cls):
    assert "entry" in vars(cls), f"{cls.__qualname__} inherits its entry: give it its own heading"
    message = str(cls("Something went wrong: do this."))
    assert message == f"Something went wrong: do this (help: {links.troubleshooting(cls.entry)})."
    assert "\n" not in message and ". " not in message  # still one sentence


def test_no_helpers_module_raises_a_bare_course_error_that_would_link_to_no_entry_of_its_own():
    bare = []
    for path in sorted((ROOT / "helpers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name)
                    and node.exc.func.id == "CourseError"):
                bare.append(f"{path.name}:{node.lineno}")
    assert bare == []


def test_the_pages_own_links_land_on_its_headings():
    text = PAGE.read_text()
    internal = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert internal and internal <= anchors(text), internal - anchors(text)


def test_the_page_holds_the_seed_articles_eight_pitfalls_by_their_messages():
    text = PAGE.read_text()
    rows = re.findall(r"^\| (\d) \| (.+?) \| \[", text, re.M)
    assert [n for n, _ in rows] == [str(i) for i in range(1, 9)]
    for message in ("os error 1455", "has no attribute 'hf_device_map'", "bytes of buffer for offloaded layers",
                    "string indices must be integers", "gggggemma", "xethub"):
        assert message.lower() in text.lower()


def test_the_page_prints_the_same_commands_as_the_setup_check():
    text = PAGE.read_text()
    assert environment.PAGE_FILE_FIX in text
    for name, _, _ in course.CUDA_TORCH_INDEXES:
        assert name in text
    assert f"--index-url {course.CUDA_TORCH_INDEXES[0][2]}" in text
