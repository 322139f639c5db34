"""One model location: notebook 01 downloads once, and every later notebook's `models.resolve` finds that
download without a single network request (beside the control: without the verified record it does reach out)."""

import socket

import pytest

from helpers import download, mirror, models

REPO = "google/gemma-4-E4B-it"


class NetworkUsed(BaseException):
    """Raised at the first name lookup or connection: a BaseException, so that no retry loop swallows it."""


@pytest.fixture
def no_network(monkeypatch):
    """Every name lookup and outgoing connection is refused and remembered (a request to the Hub starts with
    a lookup of huggingface.co, one to a mirror with a connect)."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise NetworkUsed(f"a network call was made: {args[:2]}")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


@pytest.fixture
def downloaded_as_in_notebook_01(tiny_path, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("GEMMA_COURSE_CACHE", str(tmp_path / "course-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))  # nothing there to fall back on
    with mirror.Mirror(tiny_path, REPO, workdir=tmp_path / "mirror", lfs_threshold=100_000) as served:
        result = download.download(REPO, download.course_folder(REPO), endpoint=served.endpoint, max_attempts=2)
    assert set(result.checks.values()) == {"ok"}
    return result.path


def test_a_later_notebook_finds_notebook_01s_download_without_any_network_request(downloaded_as_in_notebook_01, no_network):
    assert models.resolve(REPO) == downloaded_as_in_notebook_01
    assert no_network == []


def test_without_the_verified_record_resolve_reaches_for_the_network(downloaded_as_in_notebook_01, no_network):
    """The control: the guard above sees a request when resolve has to make one."""
    (downloaded_as_in_notebook_01 / ".cache" / download.VERIFIED_RECORD).unlink()
    with pytest.raises(NetworkUsed):
        models.resolve(REPO)
    assert no_network


def test_a_download_that_never_finished_verifying_is_not_trusted(downloaded_as_in_notebook_01):
    weights = downloaded_as_in_notebook_01 / "model.safetensors"
    weights.unlink()
    assert download.verified_download(REPO) is None


def test_the_course_folder_is_one_path_per_repository_inside_the_course_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMA_COURSE_CACHE", str(tmp_path))
    assert download.course_folder(REPO) == tmp_path / "downloads" / "google--gemma-4-E4B-it"
    with pytest.raises(download.ModelNotFoundError):
        download.course_folder("../etc")
