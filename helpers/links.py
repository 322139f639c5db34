"""The course's addresses: where its repository lives, the "Open in Colab" link of each notebook and
the troubleshooting entry each error points to. The repository's address is written here and only here:
the badges and install cells of the notebooks are rendered from it (``python -m helpers.course colab --write``)
and ``tests/test_colab.py`` fails when one of them no longer matches.
"""

from __future__ import annotations

# Filled in when the course is published: change this line, then run `python -m helpers.course colab --write`.
COURSE_REPOSITORY = "https://github.com/<owner>/gemma4-small-gpu-course"
BRANCH = "main"
TROUBLESHOOTING_PAGE = "docs/troubleshooting.md"
INSTRUCTOR_GUIDE = "docs/instructor-guide.md"
COLAB_BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"


def repository_name() -> str:
    """The folder a ``git clone`` of the course creates."""
    return COURSE_REPOSITORY.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git")


def github_path() -> str:
    """``owner/name`` as Colab's ``/github/`` links spell it."""
    return COURSE_REPOSITORY.rstrip("/").split("github.com/", 1)[-1].removesuffix(".git")


def colab_url(notebook: str) -> str:
    """Colab opens a notebook straight from the repository: ``notebook`` is its path in it, e.g. notebooks/00_setup.ipynb."""
    return f"https://colab.research.google.com/github/{github_path()}/blob/{BRANCH}/{notebook}"


def colab_badge(notebook: str) -> str:
    """The Markdown of the "Open in Colab" badge for one notebook."""
    return f"[![Open In Colab]({COLAB_BADGE_IMAGE})]({colab_url(notebook)})"


def page_url(path: str, anchor: str = "") -> str:
    """A file of the repository as the browser shows it, with an optional heading anchor."""
    return f"{COURSE_REPOSITORY}/blob/{BRANCH}/{path}" + (f"#{anchor}" if anchor else "")


def troubleshooting(entry: str) -> str:
    """The link to one entry of docs/troubleshooting.md (``entry`` is the heading's anchor)."""
    return page_url(TROUBLESHOOTING_PAGE, entry)
