"""Where the course keeps its files."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"
CONFIG_DIR = DATA_DIR / "configs"


def cache_dir() -> Path:
    """Synthetic checkpoints live here; ``GEMMA_COURSE_CACHE`` moves them (e.g. to a bigger disk)."""
    override = os.environ.get("GEMMA_COURSE_CACHE")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "gemma-course"
