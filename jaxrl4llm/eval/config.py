"""EvalConfig: the held-out evaluation's options (the `evaluation` group of the training
config), the same in the trainer and in experiments/evaluate.py."""

from __future__ import annotations

import dataclasses

from jaxrl4llm.eval import sets as eval_sets
from jaxrl4llm.eval.sets import EvalSet


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation, the same in the trainer and in experiments/evaluate.py.

    eval_data: Held-out prompt source (default: --data, split test).
    eval_every: Steps between evaluations (0 = only at the end).
    eval_prompts: Held-out prompts per evaluation: the first N of the split; -1 = the whole
        split; 0 = no evaluation.
    eval_samples: Samples per prompt: the k of avg@k / pass@k / maj@k (1 = greedy accuracy
        only).
    eval_sets: Named evaluation sets, each with its own protocol, logged as eval/NAME/METRIC
        and eval/mean/METRIC: ITEM[,ITEM...], ITEM = NAME[=SOURCE][;OPT...], OPT one of
        greedy, avg@K, pass@K, maj@K, t=FLOAT, max_new_tokens=INT, prompts=N, revision=REV;
        e.g. math500;avg@16;t=1.0,aime24;pass@8 (see jaxrl4llm/eval/sets.py).
    """

    eval_data: str | None = None
    eval_every: int = 0
    eval_prompts: int = 64
    eval_samples: int = 1
    eval_sets: str | None = None

    @property
    def sets(self) -> tuple[EvalSet, ...]:  # (the field eval_sets hides the module here)
        """The parsed --eval_sets."""
        return eval_sets.parse_eval_sets(self.eval_sets, self.eval_samples)

    def count(self, available: int) -> int:
        """How many of `available` held-out prompts an evaluation uses."""
        return available if self.eval_prompts < 0 else min(self.eval_prompts, available)
