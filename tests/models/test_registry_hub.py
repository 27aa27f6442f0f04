"""--model=OWNER/NAME: a Hugging Face Hub model id, read from the hub cache or downloaded;
without network it fails within seconds naming the cache and the `hf download` command
(HF_ENDPOINT at a closed loopback port, so the test is the same on a machine with network)."""

from __future__ import annotations

import time

import pytest

from jaxrl4llm.config.errors import ModelNotFoundError, UserError
from jaxrl4llm.models import registry

CLOSED_ENDPOINT = "http://127.0.0.1:9"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_ENDPOINT)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for proxy in (
        "http_proxy",
        "https_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
    ):
        monkeypatch.delenv(proxy, raising=False)
    return tmp_path / "hub"


def _cache_model(cache, repo):
    """A snapshot of `repo` in the hub cache's layout (refs/main -> snapshots/COMMIT)."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    commit = "0" * 40
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return snapshot


def test_no_network_fails_fast_naming_the_cache_and_the_command(cache):
    registry.check("owner/model")  # a hub id passes the flag check (it loads later)
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as err:
        registry.resolve("owner/model")
    assert time.perf_counter() - start < 5
    message = str(err.value)
    assert isinstance(err.value, UserError) and "\n" not in message
    assert "--model=owner/model" in message and CLOSED_ENDPOINT in message
    assert f"`hf download owner/model --cache-dir {cache}`" in message


def test_a_cached_model_without_network_names_hf_hub_offline_and_loads_with_it(cache, monkeypatch):
    snapshot = _cache_model(cache, "owner/cached")
    with pytest.raises(ModelNotFoundError, match="set HF_HUB_OFFLINE=1"):
        registry.resolve("owner/cached")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert registry.resolve("owner/cached") == str(snapshot)


def test_offline_an_uncached_model_fails_the_flag_check(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="hf download owner/model"):
        registry.check("owner/model", flag="--critic_model")


def test_a_folder_without_weights_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="without config.json and"):
        registry.check(str(tmp_path))
