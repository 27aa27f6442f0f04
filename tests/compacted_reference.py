"""The fixed-batch compacted sampler (sampling/decode.py) as the trainer's exactness reference.

The trainer has one rollout engine, the paged one (--rollout_engine). A run inside
`compacted_rollouts()` samples its rollouts and evaluations with the compacted sampler instead
(and multi-turn rollouts with the dense engine, sampling/multiturn.py), which gives the same
samples by a different computation: the reference a paged run is compared with. A test seam,
not a trainer option: it swaps the sampler the rollout context builds
(sampling.context.RolloutContext.create).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest

from jaxrl4llm.sampling import context

# Put at the top of a worker script (a run in a subprocess) to do the same there.
WORKER_PATCH = """
from jaxrl4llm.sampling import context as _context
_Sampler = _context.Sampler
_context.Sampler = lambda *a, **kw: _Sampler(*a, **{**kw, "kv_cache_tokens": None})
"""


@contextlib.contextmanager
def compacted_rollouts() -> Iterator[None]:
    """Runs inside sample with the compacted sampler (no page pool)."""
    real = context.Sampler

    def compacted(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **{**kwargs, "kv_cache_tokens": None})

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(context, "Sampler", compacted)
        yield
