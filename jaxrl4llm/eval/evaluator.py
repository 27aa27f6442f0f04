"""The evaluator: greedy accuracy, avg@k, unbiased pass@k, maj@k over held-out prompts.

The trainer's periodic eval and the evaluation CLI share `held_out_records`, `evaluate_run`
(both of: `evaluate`, the one --eval_data set, and `evaluate_sets`, the named --eval_sets of
eval/sets.py) and `eval_key` (the key of the eval after a given step). Completions are drawn
and scored by the trainer's own entry point (sampling.rounds.sample_and_score); the
statistics over them are eval/protocols.py's. maj@k votes on each task's own final answer
(the reward function's answer_keys: the math answer, the countdown expression, the
knights-and-knaves claims, the reasoning-gym answer). An optional `sink` receives every
completion's record (eval/samples.py: prompt, completion, answer key, verdict) as it is
scored; the trainer passes none.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxrl4llm.data import make_source
from jaxrl4llm.data.config import DataConfig
from jaxrl4llm.eval import sets as eval_sets
from jaxrl4llm.eval.config import EvalConfig
from jaxrl4llm.eval.protocols import majority_correct, set_metrics, summarize
from jaxrl4llm.eval.samples import HELD_OUT, Sink, sample_records
from jaxrl4llm.sampling.context import RolloutContext
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.rounds import ScoredRows, sample_and_score
from jaxrl4llm.sampling.strategies import GREEDY, SamplingConfig


def held_out_records(data: DataConfig, config: EvalConfig, split: str = "test") -> list[Any]:
    """The evaluation prompts: the first --eval_prompts records of the held-out source
    (--eval_data, else --data) split; -1 takes the whole split, 0 none."""
    if config.eval_prompts == 0:
        return []
    source = make_source(
        config.eval_data or data.source, split=split, revision=data.revision, **data.field_names
    )
    return [source[i] for i in range(config.count(len(source)))]


class Drawn(NamedTuple):
    greedy_P: np.ndarray | None  # bool [P]: greedy completion correct
    correct_PK: np.ndarray  # bool [P, K] (K may be 0)
    answers_PK: list[list[str | None]]  # each sample's answer key (maj@k)


def _scored_groups(
    ctx: RolloutContext,
    params: Any,
    records: Sequence[Any],
    key: jax.Array,
    group_size: int,
    sampling: SamplingConfig | None = None,
) -> ScoredRows:
    """`group_size` completions of each record, in the rollout's row layout, scored."""
    rows, _ = sample_and_score(
        ctx,
        params,
        records,
        key,
        RowLayout(group_size, ctx.rollout.share_prompts),
        sampling=sampling,
    )
    return rows


def _answer_keys(ctx: RolloutContext, rows: ScoredRows, batch: list[Any]) -> list[str | None]:
    """Each row's answer key (the one maj@k votes on)."""
    return ctx.reward_fn.answer_keys(rows.samples.texts, rows.samples.layout.repeat(batch))


def draw(
    ctx: RolloutContext,
    params: Any,
    records: Sequence[Any],
    *,
    greedy: bool,
    samples: int,
    key: jax.Array,
    prompts_per_batch: int = 16,
    progress: bool = False,
    set_name: str = HELD_OUT,
    sink: Sink | None = None,
) -> Drawn:
    """Greedy completions (if `greedy`) and `samples` sampled completions of every record,
    scored, with each sample's answer key. `sink` (optional) receives each scored batch's
    per-sample records (eval/samples.py), named `set_name`, as they arrive."""
    greedy_P: list[bool] = []
    table: list[np.ndarray] = []
    answers: list[list[str | None]] = []
    chunks = range(0, len(records), prompts_per_batch)
    desc = "eval" if set_name == HELD_OUT else f"eval {set_name}"
    for start in tqdm(chunks, desc=desc, disable=not progress, leave=False):
        batch = list(records[start : start + prompts_per_batch])
        if greedy:
            rows = _scored_groups(ctx, params, batch, key, 1, GREEDY)
            greedy_P.extend(rows.verdicts.correct.tolist())
            if sink is not None:
                keys = _answer_keys(ctx, rows, batch)
                sink(sample_records(ctx, batch, rows, keys, set_name, start, greedy=True))
        if samples:
            rows = _scored_groups(ctx, params, batch, jax.random.fold_in(key, start), samples)
            table.extend(rows.verdicts.correct.reshape(len(batch), samples))
            keys = _answer_keys(ctx, rows, batch)
            answers.extend(keys[i * samples : (i + 1) * samples] for i in range(len(batch)))
            if sink is not None:
                sink(sample_records(ctx, batch, rows, keys, set_name, start, greedy=False))
    correct = np.array(table, dtype=bool).reshape(len(records), samples)
    return Drawn(np.array(greedy_P, dtype=bool) if greedy else None, correct, answers)


def evaluate(
    ctx: RolloutContext,
    params: Any,
    records: Sequence[Any],
    *,
    samples: int = 1,
    key: jax.Array | None = None,
    prompts_per_batch: int = 16,
    prefix: str = "eval/",
    progress: bool = False,
    sink: Sink | None = None,
) -> dict[str, float]:
    """Greedy accuracy, and with `samples` = k > 1 also avg@k / pass@k / maj@k, over `records`
    (`sink`: see `draw`).

    The trainer's periodic eval and experiments/evaluate.py both call this, with the rollout's
    context (sampling front-end, reward function, prompt format, max_new_tokens).
    """
    if not records:
        raise ValueError("No evaluation records: check --eval_data and --eval_prompts.")
    key = jax.random.key(0) if key is None else key
    k = samples if samples > 1 else 0
    drawn = draw(
        ctx,
        params,
        records,
        greedy=True,
        samples=k,
        key=key,
        prompts_per_batch=prompts_per_batch,
        progress=progress,
        sink=sink,
    )
    assert drawn.greedy_P is not None  # drawn with greedy=True
    out = {f"{prefix}accuracy": float(np.mean(drawn.greedy_P))}
    if k:
        ks = sorted({1, k} | {j for j in (2, 4, 8, 16, 32) if j < k})
        out.update(
            summarize(
                drawn.correct_PK,
                ks=ks,
                prefix=prefix,
                maj_correct_P=(majority_correct(drawn.answers_PK, drawn.correct_PK, k)),
            )
        )
    return out


def set_context(ctx: RolloutContext, eval_set: eval_sets.EvalSet) -> RolloutContext:
    """The rollout context with the set's temperature and max_new_tokens."""
    rollout = ctx.rollout
    if eval_set.temperature is not None:
        rollout = dataclasses.replace(
            rollout,
            sampling=dataclasses.replace(rollout.sampling, temperature=eval_set.temperature),
        )
    if eval_set.max_new_tokens is not None:
        rollout = dataclasses.replace(rollout, max_new_tokens=eval_set.max_new_tokens)
    return dataclasses.replace(ctx, rollout=rollout)


def eval_set_records(
    sets: Sequence[eval_sets.EvalSet], data: DataConfig, split: str = "test"
) -> list[list[Any]]:
    """Each set's prompts: the first `prompts` records of its source's split."""
    out = []
    for s in sets:
        source = make_source(s.source, split=split, revision=s.revision)
        n = len(source) if s.prompts is None else min(s.prompts, len(source))
        out.append([source[i] for i in range(n)])
    return out


def evaluate_sets(
    ctx: RolloutContext,
    params: Any,
    sets: Sequence[eval_sets.EvalSet],
    records: Sequence[Sequence[Any]],
    *,
    key: jax.Array,
    prompts_per_batch: int = 16,
    prefix: str = "eval/",
    progress: bool = False,
    sink: Sink | None = None,
) -> dict[str, float]:
    """`{prefix}NAME/METRIC` for every set and metric, `{prefix}mean/METRIC` over the sets,
    and `{prefix}NAME/num_prompts` (`sink`: see `draw`, each record named by its set)."""
    out: dict[str, float] = {}
    for i, (eval_set, set_records) in enumerate(zip(sets, records)):
        if not set_records:
            raise ValueError(f"--eval_sets {eval_set.name}: no prompts in {eval_set.source}")
        drawn = draw(
            set_context(ctx, eval_set),
            params,
            set_records,
            greedy=eval_set.greedy,
            samples=eval_set.samples,
            key=jax.random.fold_in(key, i),
            prompts_per_batch=prompts_per_batch,
            progress=progress,
            set_name=eval_set.name,
            sink=sink,
        )
        metrics = set_metrics(eval_set.metrics, drawn.greedy_P, drawn.correct_PK, drawn.answers_PK)
        out.update({f"{prefix}{eval_set.name}/{m}": v for m, v in metrics.items()})
        out[f"{prefix}{eval_set.name}/num_prompts"] = float(len(set_records))
    return eval_sets.add_means(out, tuple(sets), prefix)


def evaluate_run(
    ctx: RolloutContext,
    params: Any,
    records: Sequence[Any],
    sets: Sequence[eval_sets.EvalSet],
    set_records: Sequence[Sequence[Any]],
    *,
    samples: int,
    key: jax.Array,
    prompts_per_batch: int = 16,
    prefix: str = "eval/",
    progress: bool = False,
    sink: Sink | None = None,
) -> dict[str, float]:
    """A run's evaluation: `evaluate` over the held-out `records` (none: skipped) and
    `evaluate_sets` over the named sets (with `key` folded with 1); `sink` (optional)
    receives every completion's record (eval/samples.py) as it is scored."""
    results = (
        evaluate(
            ctx,
            params,
            records,
            samples=samples,
            key=key,
            prefix=prefix,
            prompts_per_batch=prompts_per_batch,
            progress=progress,
            sink=sink,
        )
        if records
        else {}
    )
    if sets:
        results.update(
            evaluate_sets(
                ctx,
                params,
                sets,
                set_records,
                prefix=prefix,
                key=jax.random.fold_in(key, 1),
                progress=progress,
                prompts_per_batch=prompts_per_batch,
                sink=sink,
            )
        )
    return results


def eval_key(seed: int, step: int) -> jax.Array:
    """The key of the trainer's evaluation after `step` steps of a run with `seed` (step 0:
    the one before training): the 0-based step's key (the state's key, key(seed), folded
    with the step index, as the loop's step key) folded with 2. The train loop and the
    evaluator both take it from here, so a checkpoint's evaluation samples what the run's
    own evaluation sampled."""
    if step == 0:
        return jax.random.key(seed + 2)
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step - 1), 2)
