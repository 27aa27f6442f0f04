"""Greedy decoding equals transformers PyTorch `generate(do_sample=False)` token for token
(Llama; Mistral with a sliding window shorter than prompt + completion)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the hub: everything is local

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxrl4llm.models import transformer, weights  # noqa: E402
from jaxrl4llm.sampling import Sampler, sampler  # noqa: E402
from jaxrl4llm.sampling.strategies import GREEDY  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _torch_greedy(model, prompt, max_new_tokens, stop_ids, pad_id):
    """Each prompt alone (no padding): the plainest reference."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(stop_ids),
            pad_token_id=pad_id,
            temperature=None,
            top_p=None,
            top_k=None,
        )
    return out[0, len(prompt) :].tolist()


def _ours(out):
    tokens, lengths = np.asarray(out.tokens_BT), np.asarray(out.lengths_B)
    return [tokens[r, : lengths[r]].tolist() for r in range(tokens.shape[0])]


def _tiny_random(path, config_class, **extra):
    """(torch model, our config, our params) of a tiny random transformers model."""
    torch.manual_seed(0)
    hf_config = config_class(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **extra,
    )
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    model.save_pretrained(path)
    return (model, *weights.load_hf(path))


def test_greedy_matches_transformers_on_a_tiny_random_llama(tmp_path):
    model, config, params = _tiny_random(tmp_path, transformers.LlamaConfig)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in (3, 11, 6, 17)]
    N = 12
    # Stop on a token the model does emit, so stopping is compared too.
    free = _torch_greedy(model, prompts[0], N, [2], 0)
    stop_ids = (2, free[4])
    out = sampler.generate(params, config, prompts, GREEDY, N, jax.random.key(0), stop_ids=stop_ids)
    ref = [_torch_greedy(model, p, N, stop_ids, 0) for p in prompts]
    assert _ours(out) == ref
    assert len(ref[0]) <= 5 and any(len(r) == N for r in ref)  # some stopped, some ran out


def test_greedy_with_a_sliding_window_matches_transformers(tmp_path):
    """Mistral, window 5: prompts of 3-17 tokens (left-padded to one block) and 16 new
    tokens, so prefill and the KV-cache decode steps both attend past the window. Equal to
    transformers' generate, and to the argmax of our own teacher-forced forward."""
    model, config, params = _tiny_random(
        tmp_path, transformers.MistralConfig, sliding_window=5, head_dim=16
    )
    assert config.sliding_window == 5
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 128, size=n).tolist() for n in (3, 11, 6, 17)]
    N = 16
    out = sampler.generate(params, config, prompts, GREEDY, N, jax.random.key(0), stop_ids=(2,))
    ref = [_torch_greedy(model, p, N, (2,), 0) for p in prompts]
    assert _ours(out) == ref
    assert min(len(p) + len(r) for p, r in zip(prompts, ref)) > 2 * config.sliding_window
    # Teacher-forced: each completion token is the argmax of the full forward before it.
    tokens, mask, positions = out.sequences()
    logits, _ = transformer.forward(params, config, tokens, positions, mask)
    P = out.prompt_tokens_BP.shape[1]
    argmax = np.asarray(logits[:, P - 1 : -1].argmax(-1))
    real = np.asarray(out.mask_BT)
    np.testing.assert_array_equal(argmax[real], np.asarray(out.tokens_BT)[real])


def test_greedy_matches_transformers_on_smollm2_chat_prompts(tmp_path, smollm2_policy):
    config, params, tokenizer = smollm2_policy
    greedy = Sampler(config, tokenizer)
    questions = ["What is 7 times 8?", "Name the capital of France."]
    N = 12
    texts, out = greedy.generate_text(params, questions, GREEDY, N, jax.random.key(0))
    # The reference runs the same dequantized weights through transformers' Llama. (Loading
    # the GGUF with from_pretrained(gguf_file=...) needs `accelerate`, which is not a
    # dependency, and dequantizes again for ~40 s; the GGUF reader is tested in tests/models.)
    weights.export_hf(params, config, tmp_path)
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompts = greedy.encode(questions)
    ref = [_torch_greedy(model, p, N, greedy.stop_ids, greedy.pad_id) for p in prompts]
    assert _ours(out) == ref
    assert all(t.strip() for t in texts)
    assert "56" in texts[0] or "Paris" in texts[1]  # the real model, not noise
