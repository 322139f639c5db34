"""Where the course keeps its files: the one place each data path is spelled."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"
CONFIG_DIR = DATA_DIR / "configs"
MEASUREMENTS_DIR = DATA_DIR / "measurements"  # the benchmark's records, one JSONL file per model
GPU_TIER_DIR = DATA_DIR / "gpu-tier"  # the GPU tier's records and notebook runs
PLANNER_DIR = DATA_DIR / "planner"  # the planner's calibration
BUILDS_DIR = DATA_DIR / "builds"  # how long a synthetic build took and how much host memory it needed
GGUF_DIR = DATA_DIR / "gguf"  # the llama.cpp route measured on a checkpoint (python -m helpers.gguf_route measure)
CHAT_DIR = DATA_DIR / "chat"  # what each transformers release does with a plain-string message (tools/)
BUILD_DIR = REPO_ROOT / "build"  # executed notebooks and JUnit files, never committed


def cache_dir() -> Path:
    """Synthetic checkpoints live here; ``GEMMA_COURSE_CACHE`` moves them (e.g. to a bigger disk)."""
    override = os.environ.get("GEMMA_COURSE_CACHE")
    return Path(override).expanduser() if override else Path.home() / ".cache" / "gemma-course"
