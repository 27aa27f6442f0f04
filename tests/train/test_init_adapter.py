"""--init_adapter: LoRA adapters start from a PEFT adapter folder. Saved and loaded back they
are the same arrays with the same logits; the folder's rank, alpha and targets become the
run's, and a flag that disagrees with them, a folder that is not an adapter or an adapter of
another model is a FlagError naming --init_adapter."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models import lora as lora_lib
from jaxrl4llm.models import peft_format, transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.config.checks import validate
from jaxrl4llm.train.update import adapters

from tests.models.test_lora import CFG

LORA = lora_lib.LoraConfig(rank=3, alpha=6.0, targets=("q", "v", "down"))


def _logits(params):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 7)), jnp.int32)
    mask = jnp.ones((2, 7), bool).at[0, :2].set(False)
    positions = transformer.positions_from_mask(mask)
    return np.asarray(transformer.forward(params, CFG, tokens, positions, mask)[0])


def _trained_adapters():
    """Adapters as after some training: A and B random (fresh B = 0 would hide a mix-up)."""
    fresh = lora_lib.init_adapters(CFG, LORA, jax.random.key(1))
    keys = iter(jax.random.split(jax.random.key(2), len(fresh["layers"])))
    return jax.tree.map(lambda x: 0.1 * jax.random.normal(next(keys), x.shape), fresh)


@pytest.fixture
def saved(tmp_path):
    adapters_ = _trained_adapters()
    peft_format.export_peft(adapters_, CFG, LORA, tmp_path / "adapter")
    return adapters_, str(tmp_path / "adapter")


@pytest.mark.parametrize("on_mesh", [False, True], ids=["one-device", "mesh"])
def test_saved_adapters_load_back_identical(saved, on_mesh):
    original, path = saved
    base = transformer.init_params(CFG, jax.random.key(0))
    if on_mesh:  # replicated over 8 devices, as the run places adapters next to its base
        mesh = Mesh(np.array(jax.devices()[:8]).reshape(8), ("fsdp",))
        base = jax.device_put(base, NamedSharding(mesh, PartitionSpec()))
    config = TrainConfig().replace(init_adapter=path).with_init_adapter()
    assert config.lora == LORA  # rank, alpha and targets from the file
    loaded = adapters.trainable(config.lora, CFG, base, seed=0, init=path)
    assert jax.tree.structure(loaded) == jax.tree.structure(original)
    for name, value in original["layers"].items():
        assert loaded["layers"][name].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(loaded["layers"][name]), np.asarray(value))
        if on_mesh:
            assert loaded["layers"][name].sharding.spec == PartitionSpec()
    ours = _logits(lora_lib.combine(base, loaded, LORA))
    np.testing.assert_array_equal(ours, _logits(lora_lib.combine(base, original, LORA)))
    assert np.abs(ours - _logits(base)).max() > 1e-3  # the adapters do change the model


def test_flags_that_match_or_are_left_to_the_file(saved):
    _, path = saved
    same = dict(init_adapter=path, lora_rank=3, lora_alpha=6.0, lora_targets=("q", "v", "down"))
    assert TrainConfig().replace(**same).with_init_adapter().lora == LORA
    dropout = TrainConfig().replace(init_adapter=path, lora_dropout=0.1).with_init_adapter()
    assert dropout.lora.dropout == 0.1 and dropout.lora.rank == 3  # dropout is the run's
    assert TrainConfig().with_init_adapter() == TrainConfig()  # no adapter: unchanged


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(lora_rank=8), r"--lora_rank=8 differs from the adapter's 3 .* pass --lora_rank=3"),
        (dict(lora_alpha=12.0), r"--lora_alpha=12 differs from the adapter's 6"),
        (dict(lora_targets=("q",)), r"--lora_targets=q differs from the adapter's q,v,down"),
    ],
)
def test_a_flag_that_differs_from_the_file_is_named(saved, flags, message):
    _, path = saved
    with pytest.raises(FlagError, match=message):
        TrainConfig().replace(init_adapter=path, **flags).with_init_adapter()


def test_a_folder_that_is_not_this_models_adapter_is_named(saved, tmp_path):
    _, path = saved
    with pytest.raises(FlagError, match=r"--init_adapter=.*nowhere: cannot read adapter_config"):
        TrainConfig().replace(init_adapter=str(tmp_path / "nowhere")).with_init_adapter()
    with pytest.raises(FlagError, match="--init_adapter=.* starts LoRA adapters, but --lora_rank"):
        validate(TrainConfig().replace(init_adapter=path), 1)  # not resolved
    config_file = tmp_path / "adapter" / peft_format.ADAPTER_CONFIG
    dora = json.loads(config_file.read_text()) | {"use_dora": True}
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / peft_format.ADAPTER_CONFIG).write_text(json.dumps(dora))
    with pytest.raises(FlagError, match="--init_adapter=.*dora: .*use_dora"):
        TrainConfig().replace(init_adapter=str(tmp_path / "dora")).with_init_adapter()
    # An adapter of a 2-layer model on a 3-layer one; of a wider model.
    base = transformer.init_params(CFG, jax.random.key(0))
    for other, match in (
        (ModelConfig(**{**vars(CFG), "num_layers": 3}), r"lacks .*layers\.2\..* another model"),
        (ModelConfig(**{**vars(CFG), "hidden_size": 32}), r"q_proj.lora_A is \[16, 3\] .*"),
    ):
        with pytest.raises(FlagError, match="--init_adapter: .*" + match):
            adapters.trainable(LORA, other, base, seed=0, init=path)
    rank_2 = lora_lib.LoraConfig(rank=2, alpha=6.0, targets=LORA.targets)
    with pytest.raises(FlagError, match="holds a rank-3 adapter .* the run's is rank 2"):
        adapters.trainable(rank_2, CFG, base, seed=0, init=path)
