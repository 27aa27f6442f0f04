"""The sampling front-end: one `Sampler` for training, evaluation, tests and benchmarks.

It decides, once, what every caller of the compiled sampler (sampler.generate) must agree on:
the stop ids, the pad id, the prompt limit and what to do with longer prompts, the row layout
(a prompt's G samples are consecutive rows; with share_prompts its prefill runs once), and
how completions decode to text (stop token excluded). Greedy decoding reports temperature-1
logprobs (SamplingConfig.effective_temperature), the rule the teacher-forced passes follow.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models import transformer
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.sampling import buckets, continuous, multiturn, trim
from jaxrl4llm.sampling.layout import RowLayout
from jaxrl4llm.sampling.row_io import host_rows
from jaxrl4llm.sampling.sample_output import SampleOutput
from jaxrl4llm.sampling.sampler import LONG_PROMPT_MODES, generate
from jaxrl4llm.sampling.strategies import SamplingConfig
from jaxrl4llm.sampling.turns import TurnHandler, TurnLimits


@dataclasses.dataclass(frozen=True)
class Samples:
    """What the front-end returns: the device output, this host's completion texts (one per
    row, stop token excluded) and the layout of the rows; multi-turn rollouts also give
    their turn stats."""

    out: SampleOutput
    texts: list[str]
    layout: RowLayout
    turns: multiturn.TurnStats | None = None

    def host(self, x: jax.Array) -> np.ndarray:
        """This host's rows of an output array (one per text), e.g. host(out.lengths_B)."""
        return host_rows(x, len(self.texts))


class Sampler:
    """The one sampling front-end (training, evaluation, tests, tools/bench_sampler.py): what
    stays fixed over a run (model config, tokenizer, stop ids, pad id, mesh, limits).

        sampler = Sampler(config, tokenizer, mesh=mesh)
        out = sampler.generate(params, prompt_ids, SamplingConfig(1.0), 256, key, group_size=8)
        texts, out = sampler.generate_text(params, ["What is 2+3?"], GREEDY, 64, key)

    Stop ids: `stop_ids` if given (() samples exactly max_new_tokens tokens), else the model's
    eos ids plus the tokenizer's stop tokens (e.g. "<|im_end|>") plus `extra_stop_ids`. Pad id:
    `pad_id`, else the tokenizer's, else the model's, else 0. Greedy decoding reports
    temperature-1 logprobs (SamplingConfig.effective_temperature). `max_rows` caps the rows
    decoded at once (more run as strided chunks in the same program; the same samples).
    `compact=False` keeps finished rows in the decode batch (decode.py; the same samples).
    `decode_slots` > 0 decodes that many rows at a time, a finished row's slot taking the next
    queued row (continuous batching, continuous.py; the same samples); with a mesh, a
    multiple of its data-parallel size. `kv_cache_tokens` (not None): the paged engine
    (paged.py), a pool of that many tokens of KV (0: every row of a call at full length),
    groups admitted as its pages free, at most `max_rows` rows decoding at once (the same
    samples). `record_routing`: a mixture of experts' samples carry each token's experts
    (SampleOutput.prompt_experts_BPLK / experts_BTLK; routing replay).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any = None,
        *,
        mesh: Mesh | None = None,
        rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
        stop_ids: Sequence[int] | None = None,
        extra_stop_ids: Sequence[int] = (),
        pad_id: int | None = None,
        max_prompt_len: int | None = None,
        long_prompts: str = "error",
        min_prompt_bucket: int = buckets.MIN_PROMPT_BUCKET,
        max_rows: int | None = None,
        compact: bool = True,
        decode_slots: int = 0,
        kv_cache_tokens: int | None = None,
        record_routing: bool = False,
    ):
        if long_prompts not in LONG_PROMPT_MODES:
            raise ValueError(f"long_prompts={long_prompts!r} must be one of {LONG_PROMPT_MODES}.")
        continuous.check_slots(decode_slots, mesh, rules)
        if stop_ids is None:
            stop_ids = list(model_config.eos_token_ids)
            stop_ids += list(getattr(tokenizer, "stop_token_ids", ()))
            stop_ids += list(extra_stop_ids)
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.mesh, self.rules = mesh, rules
        self.stop_ids = tuple(dict.fromkeys(int(s) for s in stop_ids))
        if pad_id is None:
            pad_id = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad_id if pad_id is not None else (model_config.pad_token_id or 0))
        self.max_prompt_len = max_prompt_len
        self.long_prompts = long_prompts
        self.min_prompt_bucket = min_prompt_bucket
        self.max_rows = max_rows
        self.compact = compact
        self.decode_slots = decode_slots
        self.kv_cache_tokens = kv_cache_tokens
        self.record_routing = record_routing

    def shard_params(self, params: Any) -> Any:
        """Places params on the sampler's mesh (a no-op without one)."""
        if self.mesh is None:
            return params
        return parallel.shard_pytree(
            params, transformer.param_logical_axes(self.model_config), self.mesh, self.rules
        )

    def _row_settings(self) -> dict[str, Any]:
        """What both samplers (generate, generate_turns) take from this front-end as is."""
        return dict(
            stop_ids=self.stop_ids,
            pad_id=self.pad_id,
            long_prompts=self.long_prompts,
            min_prompt_bucket=self.min_prompt_bucket,
            mesh=self.mesh,
            rules=self.rules,
        )

    def generate(
        self,
        params: Any,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        max_new_tokens: int,
        key: jax.Array,
        *,
        group_size: int = 1,
        share_prompts: bool = True,
        row_keys: jax.Array | None = None,
        greedy_last: int = 0,
        prefixes: Sequence[Sequence[int]] | None = None,
        row_caps: Sequence[int] | None = None,
    ) -> SampleOutput:
        """`group_size` samples of each prompt (token ids), laid out as
        RowLayout(group_size, share_prompts), the last `greedy_last` of each greedy, row r
        stopping at row_caps[r] tokens if given (0: it does not run; a prompt's rows all or
        none); see the module function `generate`.

        `prefixes` (one token list per prompt, group_size 1) continue completions begun
        earlier (partial rollouts): prompt r followed by prefixes[r] is prefilled as one
        prompt, which rebuilds the KV cache, and up to max_new_tokens more tokens follow. The
        output's prompt block holds prompt + prefix; its completion columns the new tokens
        only. The prompts were checked against the limit when their completions began, so
        prompt + prefix is not held to it."""
        limit = self.max_prompt_len
        if prefixes is not None:
            if group_size != 1 or len(prefixes) != len(prompts):
                raise ValueError(
                    f"prefixes: one per prompt with group_size=1, got "
                    f"{len(prefixes)} for {len(prompts)} prompts x {group_size}."
                )
            prompts = [list(p) + list(x) for p, x in zip(prompts, prefixes)]
            limit = max(len(p) for p in prompts)
        return generate(
            params,
            self.model_config,
            prompts,
            sampling,
            max_new_tokens,
            key,
            n=group_size,
            max_prompt_len=limit,
            row_keys=row_keys,
            share_prompts=share_prompts,
            max_rows=self.max_rows,
            greedy_last=greedy_last,
            compact=self.compact,
            decode_slots=self.decode_slots,
            row_caps=row_caps,
            kv_cache_tokens=self.kv_cache_tokens,
            record_routing=self.record_routing,
            **self._row_settings(),
        )

    def encode(
        self, prompts: Sequence[Any], *, chat: bool = True, system: str | None = None
    ) -> list[list[int]]:
        """Texts (or chat message lists) -> token ids, through the chat template by default."""
        if self.tokenizer is None:
            raise ValueError(
                "This Sampler has no tokenizer; pass one to Sampler(...) to "
                "sample from text, or call generate() with token ids."
            )
        if chat:
            return [self.tokenizer.encode_chat(p, system) for p in prompts]
        return [self.tokenizer.encode(p) for p in prompts]

    def decode(self, out: SampleOutput, num_rows: int | None = None) -> list[str]:
        """This host's first `num_rows` completion texts (default: all rows), stop token
        excluded (rows of dropped prompts decode to "")."""
        num_rows = out.tokens_BT.shape[0] if num_rows is None else num_rows
        rows = trim.text_token_ids(
            *(host_rows(x, num_rows) for x in (out.tokens_BT, out.lengths_B, out.truncated_B))
        )
        return ["" if ids is None else self.tokenizer.decode(ids) for ids in rows]

    def sample(
        self,
        params: Any,
        prompts: Sequence[Any],
        sampling: SamplingConfig,
        max_new_tokens: int,
        key: jax.Array,
        layout: RowLayout = RowLayout(),
        *,
        chat: bool = True,
        system: str | None = None,
        greedy_last: int = 0,
        handler: TurnHandler | None = None,
        limits: TurnLimits = TurnLimits(),
    ) -> Samples:
        """Texts or chat message lists -> `layout.group_size` samples of each, decoded (the
        last `greedy_last` of each greedily). With a turn `handler`, multi-turn trajectories
        (multiturn.generate_turns: one host, `limits`; texts hold the observations too)."""
        ids = self.encode(prompts, chat=chat, system=system)
        turns = None
        if handler is None:
            out = self.generate(
                params,
                ids,
                sampling,
                max_new_tokens,
                key,
                group_size=layout.group_size,
                share_prompts=layout.share_prompts,
                greedy_last=greedy_last,
            )
        else:
            out, turns = self.generate_turns(
                params, ids, sampling, max_new_tokens, key, handler, limits, layout, greedy_last
            )
        texts = self.decode(out, len(prompts) * layout.group_size)
        return Samples(out=out, texts=texts, layout=layout, turns=turns)

    def generate_turns(
        self,
        params: Any,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        max_new_tokens: int,
        key: jax.Array,
        handler: TurnHandler,
        limits: TurnLimits,
        layout: RowLayout = RowLayout(),
        greedy_last: int = 0,
    ) -> tuple[SampleOutput, multiturn.TurnStats]:
        """Multi-turn trajectories of each prompt (token ids), answered by `handler`, rows
        laid out as `generate`'s, on the sampler's mesh, or with `kv_cache_tokens` on pages
        (paged_turns.py; on a mesh a pool per batch shard, paged_turns_mesh.py); see
        multiturn.generate_turns; `max_rows` decoding at once on pages only."""
        rows = len(prompts) * layout.group_size
        if self.kv_cache_tokens is None and self.max_rows and self.max_rows < rows:
            raise FlagError(
                f"max_rows={self.max_rows}: multi-turn rollouts on the compacted engine keep "
                "a cache row for every row for the whole trajectory, so they cannot decode "
                "fewer rows at once; sample on pages (kv_cache_tokens) or with max_rows=None."
            )
        return multiturn.generate_turns(
            params,
            self.model_config,
            prompts,
            sampling,
            max_new_tokens,
            key,
            handler,
            limits,
            n=layout.group_size,
            max_prompt_len=self.max_prompt_len,
            share_prompts=layout.share_prompts,
            greedy_last=greedy_last,
            kv_cache_tokens=self.kv_cache_tokens,
            max_rows=self.max_rows,
            **self._row_settings(),
        )

    def generate_text(
        self,
        params: Any,
        prompts: Sequence[Any],
        sampling: SamplingConfig,
        max_new_tokens: int,
        key: jax.Array,
        *,
        group_size: int = 1,
        chat: bool = True,
        system: str | None = None,
    ) -> tuple[list[str], SampleOutput]:
        """Applies the chat template, samples, and decodes; returns (texts [B], output)."""
        samples = self.sample(
            params,
            prompts,
            sampling,
            max_new_tokens,
            key,
            RowLayout(group_size),
            chat=chat,
            system=system,
        )
        return samples.texts, samples.out
