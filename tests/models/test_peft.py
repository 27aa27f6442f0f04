"""PEFT interop: our adapters saved as a PEFT folder load onto the transformers model with our
logits, and a PEFT folder loads back as the same adapters."""

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PEFT round trip runs transformers (torch)")
pytest.importorskip("peft", reason="PEFT is not installed (pip install peft; the 'test' extra)")

import peft  # noqa: E402

from jaxrl4llm.models import lora as lora_lib  # noqa: E402
from jaxrl4llm.models import peft_format, weights  # noqa: E402

from tests.models.test_weights import (  # noqa: E402
    _batch,
    _our_logits,
    _saved_model,
    _torch_logits,
    root,  # noqa: F401 (fixture)
)


@pytest.mark.parametrize(
    "family, targets",
    [
        ("qwen2_bias_tied", lora_lib.TARGETS),
        ("llama3_untied", ("q", "v", "down")),
    ],
)
def test_peft_loads_our_adapters_with_our_logits(root, tmp_path, family, targets):  # noqa: F811
    model, path = _saved_model(family, root)
    config, base = weights.load_hf(path)
    lora = lora_lib.LoraConfig(rank=4, alpha=8.0, targets=targets)
    adapters = lora_lib.init_adapters(config, lora, jax.random.key(1))
    # B random too: fresh adapters (B = 0) would pass with any layout.
    adapters = {
        "layers": {
            k: v if k.endswith("_a") else 0.05 * jax.random.normal(jax.random.key(i), v.shape)
            for i, (k, v) in enumerate(sorted(adapters["layers"].items()))
        }
    }
    peft_format.export_peft(adapters, config, lora, tmp_path / "adapter", base_model=path)
    tokens, mask, positions = _batch()
    ours = _our_logits(lora_lib.combine(base, adapters, lora), config, tokens, mask, positions)
    assert np.abs(ours - _our_logits(base, config, tokens, mask, positions)).max() > 1e-2

    peft_model = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    try:
        theirs = _torch_logits(peft_model, tokens, mask, positions)
    finally:
        peft_model.unload()  # the cached base model stays as it was for other tests
    m = mask.astype(bool)
    np.testing.assert_allclose(ours[m], theirs[m], atol=2e-4, rtol=2e-4)

    loaded, loaded_lora = peft_format.load_peft(tmp_path / "adapter", config)
    assert loaded_lora == lora
    for name, value in adapters["layers"].items():
        np.testing.assert_array_equal(loaded["layers"][name], np.asarray(value))


def test_an_unsupported_peft_adapter_is_named(root, tmp_path):  # noqa: F811
    _, path = _saved_model("llama_tied", root)
    config, _ = weights.load_hf(path)
    lora = lora_lib.LoraConfig(rank=2, targets=("q",))
    peft_format.export_peft(
        lora_lib.init_adapters(config, lora, jax.random.key(0)), config, lora, tmp_path
    )
    text = (tmp_path / peft_format.ADAPTER_CONFIG).read_text()
    (tmp_path / peft_format.ADAPTER_CONFIG).write_text(
        text.replace('"use_dora": false', '"use_dora": true')
    )
    with pytest.raises(ValueError, match="use_dora"):
        peft_format.load_peft(tmp_path, config)


def test_a_peft_written_adapter_starts_a_run_with_peft_logits(root, tmp_path):  # noqa: F811
    """An adapter PEFT itself trained and saved (B random: init_lora_weights=False), given as
    --init_adapter: the run's rank, alpha and targets are the file's, and its policy's
    logits are PEFT's on the transformers model."""
    from jaxrl4llm.train.config import TrainConfig
    from jaxrl4llm.train.update import adapters

    model, path = _saved_model("llama3_untied", root)
    config, base = weights.load_hf(path)
    torch.manual_seed(3)
    peft_config = peft.LoraConfig(
        r=4,
        lora_alpha=12,
        target_modules=["k_proj", "o_proj", "gate_proj"],
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    peft_model = peft.get_peft_model(model, peft_config).eval()
    try:
        peft_model.save_pretrained(str(tmp_path / "adapter"))
        tokens, mask, positions = _batch()
        theirs = _torch_logits(peft_model, tokens, mask, positions)
    finally:
        peft_model.unload()  # the cached base model stays as it was for other tests
    run = TrainConfig().replace(init_adapter=str(tmp_path / "adapter")).with_init_adapter()
    assert run.lora == lora_lib.LoraConfig(rank=4, alpha=12.0, targets=("k", "o", "gate"))
    trained = adapters.trainable(run.lora, config, base, seed=0, init=run.model.init_adapter)
    policy = adapters.policy(run.lora, base, trained)
    ours = _our_logits(policy, config, tokens, mask, positions)
    assert np.abs(ours - _our_logits(base, config, tokens, mask, positions)).max() > 1e-2
    m = mask.astype(bool)
    np.testing.assert_allclose(ours[m], theirs[m], atol=2e-4, rtol=2e-4)
