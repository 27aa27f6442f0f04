"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE) against transformers PyTorch: logits of tiny
random models saved with save_pretrained, the export transformers loads back, greedy
generation, routing replay against transformers' router forced to the replayed experts
(values and the router's gradient), and the dispatch and router against numpy."""

from __future__ import annotations

import dataclasses
import functools
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxrl4llm.models import kv_cache, lora, moe, schema, weights  # noqa: E402
from jaxrl4llm.models import transformer as T  # noqa: E402
from jaxrl4llm.models.config import ModelConfig  # noqa: E402
from jaxrl4llm.sampling import sampler  # noqa: E402
from jaxrl4llm.sampling.strategies import GREEDY  # noqa: E402

from tests.models import test_weights  # noqa: E402
from tests.sampling.test_transformers_parity import _torch_greedy  # noqa: E402

# Three layers, so that dense and MoE layers mix; pad 0 for generate.
_SMALL = {**test_weights._SMALL, "num_hidden_layers": 3, "pad_token_id": 0}
_batch = test_weights._batch
FAMILIES = {
    # Renormalised top-2 of 8 experts in every layer (as Qwen3-30B-A3B: norm_topk_prob).
    "qwen3_moe_norm": (
        transformers.Qwen3MoeConfig,
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    # Top-1 without renormalising, every second layer sparse (layer 1 of 0..2), tied.
    "qwen3_moe_sparse_step_tied": (
        transformers.Qwen3MoeConfig,
        dict(
            num_experts=4,
            num_experts_per_tok=1,
            moe_intermediate_size=24,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
        ),
    ),
    # Layer 0 dense by mlp_only_layers, top-3 of 6 renormalised.
    "qwen3_moe_mlp_only": (
        transformers.Qwen3MoeConfig,
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            head_dim=32,
        ),
    ),
    # A shared expert beside top-2 of 6, not renormalised (Qwen1.5-MoE-A2.7B's settings).
    "qwen2_moe_shared": (
        transformers.Qwen2MoeConfig,
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        ),
    ),
    # Every token in all 4 experts, renormalised, the last layer dense, tied.
    "qwen2_moe_all_experts_mixed": (
        transformers.Qwen2MoeConfig,
        dict(
            num_experts=4,
            num_experts_per_tok=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            norm_topk_prob=True,
            mlp_only_layers=[2],
            tie_word_embeddings=True,
        ),
    ),
}
_fwd = jax.jit(T.forward, static_argnums=1)


@functools.cache
def _saved_model(family: str, root: str) -> tuple[object, str]:
    """A random torch model of `family`, saved to a folder (cached per test session)."""
    cls, extra = FAMILIES[family]
    path = os.path.join(root, family)
    return test_weights.save_random_model(cls(**_SMALL, **extra), path), path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_moe"))


def _torch_logits(model, tokens, mask, positions):
    return model(
        input_ids=torch.tensor(tokens),
        attention_mask=torch.tensor(mask.astype(int)),
        position_ids=torch.tensor(positions),
    ).logits


def _ours(params, config, tokens, mask, positions) -> np.ndarray:
    args = (jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), jnp.asarray(mask))
    return np.asarray(_fwd(params, config, *args)[0])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logit_parity_with_transformers(root, family):
    model, path = _saved_model(family, root)
    config, params = weights.load_hf(path)
    cls, extra = FAMILIES[family]
    assert config.moe_layers == tuple(
        i
        for i in range(3)
        if i not in extra.get("mlp_only_layers", [])
        and (i + 1) % extra.get("decoder_sparse_step", 1) == 0
    )
    tokens, mask, positions = _batch()
    with torch.no_grad():
        ref = _torch_logits(model, tokens, mask, positions).numpy()
    err = np.abs(_ours(params, config, tokens, mask, positions) - ref)[mask].max()
    print(f"{family}: max |logit error| = {err:.2e} (logit scale {np.abs(ref).max():.2f})")
    assert err <= 1e-5


@pytest.mark.parametrize("family", ["qwen3_moe_mlp_only", "qwen2_moe_shared"])
def test_export_round_trip_reloads_in_transformers(root, tmp_path, family):
    model, path = _saved_model(family, root)
    config, params = weights.load_hf(path)
    weights.export_hf(params, config, tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    tokens, mask, positions = _batch()
    with torch.no_grad():
        ref = _torch_logits(model, tokens, mask, positions).numpy()[mask]
        again = _torch_logits(reloaded, tokens, mask, positions).numpy()[mask]
    np.testing.assert_array_equal(again, ref)
    assert np.abs(_ours(params, config, tokens, mask, positions)[mask] - again).max() <= 1e-5
    config2, params2 = weights.load_hf(tmp_path)
    assert config2 == config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("family", ["qwen3_moe_norm", "qwen2_moe_shared"])
def test_greedy_generation_matches_transformers(root, family):
    model, path = _saved_model(family, root)
    config, params = weights.load_hf(path)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 160, size=n).tolist() for n in (3, 9, 5)]
    out = sampler.generate(params, config, prompts, GREEDY, 10, jax.random.key(0), stop_ids=(2,))
    tokens, lengths = np.asarray(out.tokens_BT), np.asarray(out.lengths_B)
    ours = [tokens[r, : lengths[r]].tolist() for r in range(len(prompts))]
    assert ours == [_torch_greedy(model, p, 10, (2,), 0) for p in prompts]


def test_greedy_decoding_with_a_cache_over_dense_and_moe_layers(root):
    """A model whose last layer is dense (layers run as a loop) decodes token by token with
    the KV cache (transformer.forward) as transformers generates."""
    model, path = _saved_model("qwen2_moe_all_experts_mixed", root)
    config, params = weights.load_hf(path)
    prompt, N = [5, 77, 12, 140, 9, 33], 8
    cache = kv_cache.init_kv_cache(config, 1, len(prompt) + N)
    tokens = jnp.asarray([prompt], jnp.int32)
    positions = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    logits, cache = _fwd(params, config, tokens, positions, jnp.ones_like(tokens, bool), cache, 0)
    ours = []
    for step in range(N):
        ours.append(int(jnp.argmax(logits[0, -1])))
        if ours[-1] == 2:  # the stop token
            break
        index = len(prompt) + step
        token = jnp.asarray([[ours[-1]]], jnp.int32)
        position = jnp.asarray([[index]], jnp.int32)
        logits, cache = _fwd(params, config, token, position, jnp.ones((1, 1), bool), cache, index)
    assert ours == _torch_greedy(model, prompt, N, (2,), 0)


def _force_routing(model, experts_LNK: list[torch.Tensor]) -> None:
    """Each sparse layer of the torch model runs the given experts [B*T, k]: its router's
    top-k replaced by them, weighted by its softmax probabilities there (renormalised as the
    config says) -- routing replay written with transformers' router."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert len(routers) == len(experts_LNK)
    for router, forced in zip(routers, experts_LNK):

        def forward(self, hidden_states, forced=forced):
            logits = torch.nn.functional.linear(
                hidden_states.reshape(-1, self.hidden_dim), self.weight
            )
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(1, forced)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), forced

        router.forward = types.MethodType(forward, router)


@pytest.mark.parametrize("family", ["qwen3_moe_mlp_only", "qwen2_moe_shared"])
def test_routing_replay_matches_transformers_with_the_router_forced(root, family):
    """Replaying random experts: the logits and the router weights' gradient of a loss equal
    transformers' model whose routers run those experts."""
    _, path = _saved_model(family, root)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()  # to patch
    config, params = weights.load_hf(path)
    tokens, mask, positions = _batch()
    L, k, E = len(config.moe_layers), config.moe.experts_per_token, config.moe.num_experts
    rng = np.random.default_rng(2)
    experts = np.argsort(rng.random((L,) + tokens.shape + (E,)), axis=-1)[..., :k]
    probe = rng.standard_normal((3, 11, 160)).astype(np.float32) * mask[..., None]

    def loss(p):
        h, _, routing = T.routed_hidden_states(
            p, config, tokens, positions, mask, experts_LBTK=jnp.asarray(experts)
        )
        return jnp.sum(T.unembed(p, config, h) * probe), (T.unembed(p, config, h), routing)

    (_, (logits, routing)), grads = jax.value_and_grad(loss, has_aux=True)(params)
    np.testing.assert_array_equal(routing.experts_BTK, experts)
    _force_routing(model, [torch.tensor(e.reshape(-1, k)) for e in experts])
    ref = _torch_logits(model, tokens, mask, positions)
    (ref * torch.tensor(probe)).sum().backward()
    assert np.abs(np.asarray(logits) - ref.detach().numpy())[mask].max() <= 1e-5
    hf_router = [
        m.weight.grad.numpy() for m in model.modules() if type(m).__name__.endswith("TopKRouter")
    ]
    ours = np.asarray(grads["layers"]["router"])  # [L, D, E]: HF's [E, D] transposed
    assert np.abs(ours).max() > 0
    np.testing.assert_allclose(ours, np.stack(hf_router).transpose(0, 2, 1), atol=2e-4, rtol=1e-3)


def _np_route(logits, k, normalize):
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    experts = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    w = np.take_along_axis(p, experts, -1)
    return experts, (w / w.sum(-1, keepdims=True) if normalize else w)


def test_route_is_softmax_top_k_and_replay_gathers():
    logits = np.random.default_rng(0).standard_normal((2, 5, 7)).astype(np.float32)
    for normalize in (False, True):
        experts, w = moe.route(jnp.asarray(logits), 3, normalize)
        want_e, want_w = _np_route(logits, 3, normalize)
        np.testing.assert_array_equal(experts, want_e)
        np.testing.assert_allclose(w, want_w, rtol=1e-6)
    replay = np.array([[[6, 0, 2]] * 5] * 2)
    _, w = moe.route(jnp.asarray(logits), 3, True, jnp.asarray(replay))
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    picked = np.take_along_axis(p, replay, -1)
    np.testing.assert_allclose(w, picked / picked.sum(-1, keepdims=True), rtol=1e-6)
    # A token without a record (negative ids, e.g. a row's last token) takes its own top-k.
    partial = replay.copy()
    partial[1, 2:] = -1
    experts, w = moe.route(jnp.asarray(logits), 3, True, jnp.asarray(partial))
    want_e, want_w = _np_route(logits, 3, True)
    np.testing.assert_array_equal(experts[1, 2:], want_e[1, 2:])
    np.testing.assert_allclose(w[1, 2:], want_w[1, 2:], rtol=1e-6)
    np.testing.assert_array_equal(experts[:, :2], replay[:, :2])
    with pytest.raises(ValueError, match="experts_per_token=2"):
        moe.route(jnp.asarray(logits), 2, True, jnp.asarray(replay))


@pytest.mark.parametrize("chunk_copies", [moe.EXPERT_CHUNK_COPIES, 6])
def test_expert_mlp_is_the_weighted_sum_of_the_held_experts(monkeypatch, chunk_copies):
    """Tokens over 8 experts, this call holding experts 2..4: a numpy loop over tokens; in
    one block, and in chunks of 2 tokens (the last padded), value and gradients alike."""
    monkeypatch.setattr(moe, "EXPERT_CHUNK_COPIES", chunk_copies)
    rng = np.random.default_rng(0)
    M, K, D, F, first, G = 13, 3, 8, 6, 2, 3
    x = rng.standard_normal((M, D)).astype(np.float32)
    experts = np.argsort(rng.random((M, 8)), -1)[:, :K]
    w = rng.random((M, K)).astype(np.float32)
    gate, up = rng.standard_normal((2, G, D, F)).astype(np.float32)
    down = rng.standard_normal((G, F, D)).astype(np.float32)
    want = np.zeros((M, D), np.float32)
    for m in range(M):
        for k in range(K):
            e = experts[m, k] - first
            if 0 <= e < G:
                g = x[m] @ gate[e]
                want[m] += w[m, k] * ((g / (1 + np.exp(-g))) * (x[m] @ up[e])) @ down[e]
    got = moe.expert_mlp(
        jnp.asarray(x), jnp.asarray(experts), jnp.asarray(w), (gate, up, down), first
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 0 and (np.abs(want).sum(-1) == 0).any()  # some rows: no held expert
    # d/dx and d/dw of sum(y * probe) against numpy: y is linear in w, and dy/dx by the
    # chain rule through the held experts' SwiGLU.
    probe = rng.standard_normal((M, D)).astype(np.float32)
    dx, dw = jax.grad(
        lambda x_, w_: jnp.sum(
            moe.expert_mlp(x_, jnp.asarray(experts), w_, (gate, up, down), first) * probe
        ),
        argnums=(0, 1),
    )(jnp.asarray(x), jnp.asarray(w))
    want_dx, want_dw = np.zeros((M, D)), np.zeros((M, K))
    for m in range(M):
        for k in range(K):
            e = experts[m, k] - first
            if 0 <= e < G:
                g, u = x[m] @ gate[e], x[m] @ up[e]
                sig = 1 / (1 + np.exp(-g))
                want_dw[m, k] = ((g * sig * u) @ down[e]) @ probe[m]
                dh = down[e] @ probe[m] * w[m, k]
                dg = dh * u * (sig + g * sig * (1 - sig))
                want_dx[m] += gate[e] @ dg + up[e] @ (dh * g * sig)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-4)


def test_config_reads_both_expert_count_names_and_refuses_what_it_cannot_run():
    hf = transformers.Qwen3MoeConfig(**_SMALL, num_experts=8, num_experts_per_tok=2).to_dict()
    assert "num_local_experts" in hf  # transformers 5's name; Hub configs say num_experts
    config = ModelConfig.from_hf_config(hf)
    assert (config.moe.num_experts, config.moe.experts_per_token) == (8, 2)
    assert config.moe_layers == (0, 1, 2)
    legacy = {k: v for k, v in hf.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert ModelConfig.from_hf_config(legacy) == config
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config
    assert config.num_params == sum(
        int(np.prod(s)) for s in jax.tree.leaves(T.param_shapes(config), is_leaf=T.is_shape)
    )
    with pytest.raises(ValueError, match="experts_per_token=9"):
        dataclasses.replace(config, moe=dataclasses.replace(config.moe, experts_per_token=9))
    with pytest.raises(ValueError, match="dense family"):
        dataclasses.replace(config, model_type="qwen3")
    with pytest.raises(ValueError, match="has none"):
        moe = dataclasses.replace(config.moe, shared_expert_intermediate_size=8)
        dataclasses.replace(config, moe=moe)
    with pytest.raises(ValueError, match="has a shared expert"):
        dataclasses.replace(config, model_type="qwen2_moe", attention_bias=True, qk_norm=False)
    qwen2 = transformers.Qwen2MoeConfig(**_SMALL, qkv_bias=False).to_dict()
    with pytest.raises(ValueError, match="qkv_bias=false"):
        ModelConfig.from_hf_config(qwen2)


def test_schema_stacks_each_leaf_over_the_layers_that_have_it():
    config = ModelConfig.from_hf_config(
        transformers.Qwen2MoeConfig(
            **_SMALL,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            mlp_only_layers=[1],
        ).to_dict()
    )
    shapes = T.param_shapes(config)["layers"]
    assert shapes["q"] == (3, 64, 4, 16) and shapes["gate"] == (1, 64, 96)
    assert shapes["router"] == (2, 64, 4) and shapes["expert_down"] == (2, 4, 16, 64)
    assert shapes["shared_gate"] == (2, 64, 24) and shapes["shared_expert_gate"] == (2, 64)
    axes = T.param_logical_axes(config)["layers"]
    assert axes["expert_gate"] == ("layers", "experts", "embed", "mlp")
    leaf = {leaf.name: leaf for leaf in schema.leaves(config)}["expert_up"]
    names = [name for name, _ in leaf.tensors(config)]
    assert names[5] == "model.layers.2.mlp.experts.1.up_proj.weight" and len(names) == 8


def test_lora_adapts_the_attention_of_a_moe_model_and_refuses_its_mlp(root):
    """Adapters on q and o: our unmerged adapters equal transformers with W + scale (A B)^T."""
    model, path = _saved_model("qwen3_moe_norm", root)
    config, params = weights.load_hf(path)
    settings = lora.LoraConfig(rank=4, alpha=8.0, targets=("q", "o"))
    lora.check_model(config, settings)
    with pytest.raises(ValueError, match="q,k,v,o"):
        lora.check_model(config, lora.LoraConfig(rank=4))
    adapters = lora.init_adapters(config, settings, jax.random.key(1))
    adapters["layers"] = {
        name: a + 0.05 * jax.random.normal(jax.random.key(2), a.shape) if name.endswith("_b") else a
        for name, a in adapters["layers"].items()
    }
    tokens, mask, positions = _batch()
    ours = _ours(lora.combine(params, adapters, settings), config, tokens, mask, positions)
    state = {name: w.clone() for name, w in model.state_dict().items()}
    for t, module in (("q", "q_proj"), ("o", "o_proj")):
        delta = np.einsum(
            "lir,lro->loi", adapters["layers"][f"{t}_lora_a"], adapters["layers"][f"{t}_lora_b"]
        )
        for i in range(3):
            state[f"model.layers.{i}.self_attn.{module}.weight"] += torch.tensor(
                settings.scale * delta[i]
            )
    merged = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    merged.load_state_dict(state)
    with torch.no_grad():
        ref = _torch_logits(merged, tokens, mask, positions).numpy()
    assert np.abs(ours - ref)[mask].max() <= 1e-5
