"""One resolver for hub ids, folders and synthetic names."""

import shutil

import pytest

from helpers import models, synthetic


def test_default_is_tiny_and_gemma_model_env_overrides_it(monkeypatch, tiny_path):
    monkeypatch.delenv("GEMMA_MODEL", raising=False)
    assert models.requested() == "tiny"
    monkeypatch.setenv("GEMMA_MODEL", "e4b-shape")
    assert models.requested() == "e4b-shape"
    assert models.requested("tiny") == "tiny"  # an argument beats the environment
    monkeypatch.setenv("GEMMA_MODEL", str(tiny_path))
    assert models.resolve() == tiny_path


def test_synthetic_names_resolve_to_a_complete_build(tiny_path):
    path = models.resolve("tiny")
    assert path == tiny_path and synthetic.is_complete(path)


def test_a_hub_id_resolves_through_the_huggingface_hub_cache(tmp_path, monkeypatch, tiny_path):
    from huggingface_hub import constants

    commit = "0" * 40
    repo = tmp_path / "models--google--gemma-4-E4B-it"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_path, repo / "snapshots" / commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("GEMMA_COURSE_CACHE", str(tmp_path / "course-cache"))  # no course download to find first
    path = models.resolve("google/gemma-4-E4B-it")
    assert path == repo / "snapshots" / commit
    assert (path / "config.json").is_file()


def test_a_file_instead_of_a_folder_is_refused(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"")
    with pytest.raises(models.NotAGemma4CheckpointError, match="folder that holds config.json"):
        models.resolve(str(target))
