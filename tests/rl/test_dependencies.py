"""`import jaxrl4llm.rl` needs jax and numpy only (the `pip install --no-deps` promise)."""

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Every other dependency of the package, and the package's own non-math modules.
BLOCKED = (
    "transformers",
    "flax",
    "optax",
    "orbax",
    "grain",
    "math_verify",
    "torch",
    "absl",
    "tensorboardX",
    "pyarrow",
    "sympy",
    "gguf",
    "tqdm",
    "matplotlib",
    "tokenizers",
    "huggingface_hub",
    "safetensors",
    "jinja2",
    "psutil",
    "jaxrl4llm.models",
    "jaxrl4llm.sampling",
    "jaxrl4llm.train",
    "jaxrl4llm.data",
    "jaxrl4llm.rewards",
    "jaxrl4llm.eval",
    "jaxrl4llm.config.cli",
    "jaxrl4llm.parallel",
)

SCRIPT = textwrap.dedent("""
    import importlib.abc, sys
    BLOCKED = {blocked!r}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ModuleNotFoundError(f"{{name}} is not installed (blocked)", name=name)
            return None

    sys.meta_path.insert(0, Refuse())
    import jax.numpy as jnp
    import jaxrl4llm.rl as rl

    cfg = rl.get_preset("grpo")
    adv, keep, metrics = rl.compute_advantages(
        cfg, jnp.array([1.0, 0.0, 1.0, 1.0]), jnp.array([True, False, True, True]),
        jnp.ones((4, 3), bool), 2)
    loss_sum, denom, _ = rl.policy_loss(cfg, jnp.zeros((4, 3)), None, adv, jnp.ones((4, 3), bool),
                                        keep, ref_logp_BT=jnp.zeros((4, 3)))
    print("ADV", [round(float(a), 4) for a in adv])
    print("LOADED", sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".")
                                                         for b in BLOCKED)))
""")


def test_rl_imports_with_only_jax_and_numpy():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(blocked=BLOCKED)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # GRPO on groups [1, 0] and [1, 1]: +-1/(std 0.7071 + 1e-6) and a flat group at 0.
    assert "ADV [0.7071, -0.7071, 0.0, 0.0]" in result.stdout
    assert "LOADED []" in result.stdout
