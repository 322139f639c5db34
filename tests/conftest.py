"""Test tiers: CPU tests always run; ``gpu`` tests skip without CUDA (see tests/gpu)."""

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def isolated_course_cache(tmp_path_factory):
    """Synthetic checkpoints go to a per-session folder, not the learner's ~/.cache."""
    if "GEMMA_COURSE_CACHE" not in os.environ:
        os.environ["GEMMA_COURSE_CACHE"] = str(tmp_path_factory.mktemp("course-cache"))
    os.environ.pop("GEMMA_MODEL", None)
    os.environ["HF_HUB_OFFLINE"] = "1"  # no test may reach the hub
    yield


@pytest.fixture(scope="session")
def tiny_path():
    from helpers import synthetic

    return synthetic.build("tiny", progress=False)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


def tiny_prompt(tokenizer, text="Where does the PLE table live?"):
    messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
