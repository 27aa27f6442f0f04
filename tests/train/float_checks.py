"""Comparisons of gradients and updates between two programs (sharded vs one device, micro-
batched vs whole, shared vs per-row prompts) that test the update, not the host's rounding.

Two XLA programs that compute the same sums in another order (another sharding, fusion or
micro-batching, or a CPU with narrower vectors) differ by a few float32 ulps of the largest
term. Two things would turn that noise into a failure:

- Adam with its default eps (1e-8) moves each weight by ~lr * sign(g) on the first step, so a
  near-zero gradient's last-bit difference becomes a step of +-lr. LINEAR_OPT is an Adam whose
  step is proportional to the gradient instead: on the first step Adam moves each weight by
  lr * g / (|g| + eps) (bias-corrected moments), so with eps >> |g| (the gradient is clipped to
  global norm 1) and lr = eps the step is g / (1 + |g| / eps) ~ g.
- A relative tolerance per element: a near-zero element carries the rounding of the large
  terms it was summed from. assert_trees_close scales the tolerance by the largest magnitude.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxrl4llm.train.update.state import OptimizerConfig

LINEAR_OPT = OptimizerConfig(learning_rate=1e3, eps=1e3)


def assert_trees_close(actual, expected, rel):
    """Leaf by leaf, to `rel` times the largest magnitude in `expected` (float32 sums in
    another order differ by a few ulps of the largest term, not of each element)."""
    scale = max(float(np.max(np.abs(x))) for x in jax.tree.leaves(expected))
    assert scale > 0, "comparing all-zero trees tests nothing"
    for (path, b), a in zip(jax.tree.leaves_with_path(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(
            np.asarray(b),
            np.asarray(a),
            rtol=0,
            atol=rel * scale,
            err_msg=jax.tree_util.keystr(path),
        )


def param_step(before, after):
    """after - before, leaf by leaf, on the host: the update an optimizer step applied."""
    return jax.tree.map(np.subtract, jax.device_get(after), jax.device_get(before))
