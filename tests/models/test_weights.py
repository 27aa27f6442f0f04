"""HF checkpoints: logit parity with transformers PyTorch, export round trip, sharded loading,
errors.

Each family is a tiny random transformers model saved with save_pretrained and loaded back
with our loader; logits are compared on a left-padded batch at the real positions only.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxrl4llm import parallel  # noqa: E402
from jaxrl4llm.models import transformer as T  # noqa: E402
from jaxrl4llm.models import weights  # noqa: E402
from jaxrl4llm.models.attention import AttentionConfig  # noqa: E402
from jaxrl4llm.models.config import ModelConfig  # noqa: E402

_SMALL = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    # Llama 3.1-style: llama3 rope scaling whose three frequency bands all occur at head_dim 16.
    "llama3_untied": (
        transformers.LlamaConfig,
        dict(
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "qwen2_bias_tied": (transformers.Qwen2Config, dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3_qknorm_untied": (transformers.Qwen3Config, dict(tie_word_embeddings=False, head_dim=32)),
    # Mistral: Llama-shaped with a sliding window, here wider than the 11-token test rows.
    "mistral_window_untied": (
        transformers.MistralConfig,
        dict(tie_word_embeddings=False, sliding_window=16, head_dim=32, rope_theta=1e6),
    ),
    # A window of 6, shorter than the test rows: later tokens attend to the last 6 only.
    "mistral_short_window_tied": (
        transformers.MistralConfig,
        dict(tie_word_embeddings=True, sliding_window=6, head_dim=16),
    ),
}
_fwd = jax.jit(T.forward, static_argnums=1, static_argnames="attention")


def save_random_model(hf_config: object, path: str) -> object:
    """A random torch model of `hf_config`, saved to `path` by transformers."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mix-up shows
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p) if p.ndim == 1 else 2.0 * p)
    model.save_pretrained(path)
    return model


@functools.cache
def _saved_model(family: str, root: str) -> tuple[object, str]:
    """A random torch model of `family`, saved to a folder (cached per test session)."""
    cls, extra = FAMILIES[family]
    path = os.path.join(root, family)
    return save_random_model(cls(**_SMALL, **extra), path), path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


def _batch(vocab: int = 160):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (3, 11))
    mask = np.arange(11)[None] >= np.array([0, 4, 9])[:, None]  # left padding
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return tokens, mask, positions


def _torch_logits(model, tokens, mask, positions) -> np.ndarray:
    with torch.no_grad():
        return (
            model(
                input_ids=torch.tensor(tokens),
                attention_mask=torch.tensor(mask.astype(int)),
                position_ids=torch.tensor(positions),
            )
            .logits.float()
            .numpy()
        )


def _our_logits(
    params, config, tokens, mask, positions, attention: AttentionConfig = AttentionConfig()
) -> np.ndarray:
    out, _ = _fwd(
        params,
        config,
        jnp.asarray(tokens, jnp.int32),
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(mask),
        attention=attention,
    )
    return np.asarray(out)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logit_parity_with_transformers(root, family):
    model, path = _saved_model(family, root)
    config, params = weights.load_hf(path)
    assert config.tie_word_embeddings == ("unembed" not in params)
    tokens, mask, positions = _batch()
    ref = _torch_logits(model, tokens, mask, positions)
    ours = _our_logits(params, config, tokens, mask, positions)
    err = np.abs(ours - ref)[mask].max()
    print(f"{family}: max |logit error| = {err:.2e} (logit scale {np.abs(ref).max():.2f})")
    assert err <= 1e-4


@pytest.mark.parametrize("family", ["llama3_untied", "qwen2_bias_tied", "mistral_window_untied"])
def test_export_round_trip_reloads_in_transformers(root, tmp_path, family):
    model, path = _saved_model(family, root)
    config, params = weights.load_hf(path)
    weights.export_hf(params, config, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens, mask, positions = _batch()
    ours = _our_logits(params, config, tokens, mask, positions)
    np.testing.assert_array_equal(
        _torch_logits(reloaded, tokens, mask, positions)[mask],
        _torch_logits(model, tokens, mask, positions)[mask],
    )
    assert np.abs(_torch_logits(reloaded, tokens, mask, positions) - ours)[mask].max() <= 1e-4
    # And our own loader reads the export back bit for bit.
    config2, params2 = weights.load_hf(tmp_path)
    assert config2 == config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(a, b)


def test_bfloat16_export_and_load(root, tmp_path):
    _, path = _saved_model("qwen3_qknorm_untied", root)
    config, params = weights.load_hf(path, dtype=jnp.bfloat16)
    assert params["layers"]["q"].dtype == jnp.bfloat16
    weights.export_hf(params, config, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
    _, params2 = weights.load_hf(tmp_path, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(params2["layers"]["down"], np.float32),
        np.asarray(params["layers"]["down"], np.float32),
    )


def test_multi_file_checkpoint_loads_onto_mesh(root, tmp_path):
    model, _ = _saved_model("llama3_untied", root)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    mesh = parallel.make_mesh("data:1,fsdp:4,tensor:2")
    config, sharded = weights.load_hf(tmp_path, mesh=mesh)
    assert sharded["layers"]["gate"].sharding.spec == jax.sharding.PartitionSpec(
        None, "fsdp", "tensor"
    )
    assert len(sharded["embed"].addressable_shards) == 8
    _, plain = weights.load_hf(tmp_path)
    tokens, mask, positions = _batch()
    np.testing.assert_allclose(
        _our_logits(sharded, config, tokens, mask, positions)[mask],
        _our_logits(plain, config, tokens, mask, positions)[mask],
        atol=2e-5,
    )


def _tamper(src: str, dst, edit) -> None:
    """Copies a saved model to dst with its tensors edited by `edit(dict) -> dict`."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    save_file(
        edit(load_file(os.path.join(src, "model.safetensors"))), str(dst / "model.safetensors")
    )


def test_checkpoint_errors_name_the_tensor(root, tmp_path):
    _, path = _saved_model("qwen3_qknorm_untied", root)
    name = "model.layers.1.self_attn.k_norm.weight"
    _tamper(path, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(KeyError, match=name.replace(".", r"\.")):
        weights.load_hf(tmp_path / "missing")
    _tamper(path, tmp_path / "shape", lambda t: {**t, name: np.ones(7, np.float32)})
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + r".*\(7,\)"):
        weights.load_hf(tmp_path / "shape")
    _tamper(path, tmp_path / "extra", lambda t: {**t, "model.extra.weight": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match=r"model\.extra\.weight"):
        weights.load_hf(tmp_path / "extra")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        weights.load_hf(tmp_path / "nowhere")


def _long_batch(length: int = 24):
    """Rows longer than the short window: no padding, 5 and 13 pads (19 and 11 tokens)."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 160, (3, length))
    mask = np.arange(length)[None] >= np.array([0, 5, 13])[:, None]
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return tokens, mask, positions


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_mistral_sliding_window_equals_transformers_past_the_window(root, impl):
    """Logits of 24-token rows under a window of 6 equal transformers' (which masks keys
    kv <= q - 6), left-padded or not; with the window off, the positions past it differ."""
    model, path = _saved_model("mistral_short_window_tied", root)
    config, params = weights.load_hf(path)
    assert (config.model_type, config.sliding_window) == ("mistral", 6)
    tokens, mask, positions = _long_batch()
    ref = _torch_logits(model, tokens, mask, positions)
    past = mask & (positions >= config.sliding_window)
    assert past[0].sum() == 18 and past[1].sum() == 13 and past[2].sum() == 5
    attention = AttentionConfig(impl, 4, 4, 0)  # chunked: 4-slot blocks, a window across them
    err = np.abs(_our_logits(params, config, tokens, mask, positions, attention) - ref)
    full = dataclasses.replace(config, sliding_window=None)
    err_full = np.abs(_our_logits(params, full, tokens, mask, positions, attention) - ref)
    print(
        f"{impl}: max |logit error| past the window {err[past].max():.2e} with the window, "
        f"{err_full[past].max():.2e} without (logit scale {np.abs(ref).max():.2f})"
    )
    assert err[mask].max() <= 1e-4
    assert err_full[mask & ~past].max() <= 1e-4 and err_full[past].max() > 0.1


def test_a_window_at_least_as_long_as_the_rows_changes_nothing(root):
    _, path = _saved_model("mistral_short_window_tied", root)
    config, params = weights.load_hf(path)
    tokens, mask, positions = _long_batch()
    full = _our_logits(
        params, dataclasses.replace(config, sliding_window=None), tokens, mask, positions
    )
    for window in (24, 100):
        np.testing.assert_array_equal(
            _our_logits(
                params, dataclasses.replace(config, sliding_window=window), tokens, mask, positions
            ),
            full,
        )


def test_sliding_window_below_one_is_a_clear_error():
    with pytest.raises(ValueError, match="sliding_window=0 must be at least 1"):
        ModelConfig(
            vocab_size=8,
            hidden_size=8,
            intermediate_size=8,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            head_dim=8,
            model_type="mistral",
            sliding_window=0,
        )
