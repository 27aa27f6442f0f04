"""train.services.setup: what it hands the data layer, before any model load."""

from __future__ import annotations

import jax
import pytest

from jaxrl4llm.train import services
from jaxrl4llm.train.config import TrainConfig


class _Stop(Exception):
    pass


def test_training_data_is_read_at_the_requested_hub_revision(monkeypatch, tmp_path):
    seen = {}

    def fake_source(spec, **kwargs):
        seen.update(kwargs, spec=spec)
        raise _Stop

    def no_model(*args, **kwargs):
        raise AssertionError("the data is read before the model loads")

    monkeypatch.setattr(services, "make_source", fake_source)
    monkeypatch.setattr(services.registry, "load_model", no_model)
    config = TrainConfig().replace(
        data="hf:someone/some-data",
        data_revision="v1.2",
        mesh="data:1,fsdp:1,tensor:1",
        workdir=str(tmp_path / "w"),
    )
    with pytest.raises(_Stop):
        services.setup(config, jax.devices()[:1])
    assert seen["spec"] == "hf:someone/some-data"
    assert seen["split"] == "train" and seen["revision"] == "v1.2"
