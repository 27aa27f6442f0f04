"""Multi-turn rollouts: the contract between the decode engine and what answers a model's turn.

The engine decodes a row until the model ends its turn: one of the row's turn-end stop sequences
(a tool-call end marker), its EOS, or its token budget. It then hands the turn to a `TurnHandler`
(`submit`, which must not block) and keeps decoding the other rows. When the handler's reply for
that row arrives (`poll`), the reply's observation tokens (a tool's output or an environment's
message, already wrapped in the model's chat template and tokenized by the handler) are appended
to the row and prefilled into its cache, and the model's next turn is decoded. A trajectory ends
when a reply says `done`, the model ends a turn with EOS or runs out of budget, or
`TurnLimits.max_turns` / `max_total_tokens` is reached.

Observation tokens are part of the sequence (the forward pass sees them) but not the model's
output: they carry no sampler logprob and are off the loss mask.

Everything here is host-side Python; the handler decides where its work runs (the reward worker
pool, so a tool that hangs or crashes costs only its own row).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Protocol, Sequence

TurnEnd = Literal["stop", "eos", "length"]
TurnStatus = Literal["ok", "error", "timeout", "crash"]


@dataclasses.dataclass(frozen=True)
class TurnLimits:
    """Per-trajectory limits of a multi-turn rollout.

    max_turns: Model turns per trajectory (1 = single-turn rollouts).
    max_total_tokens: Completion tokens per trajectory over all turns, the model's and the
        observations' (0 = --max_new_tokens).
    max_observation_tokens: One observation (a tool's output, an environment's message) is
        cut to this many tokens.
    """

    max_turns: int = 1  # model turns per trajectory; 1 = single-turn (today's rollouts)
    # Completion tokens over all turns (model and observation tokens); 0 = the run's
    # max_new_tokens.
    max_total_tokens: int = 0
    max_observation_tokens: int = 256  # one observation is cut to this many tokens


@dataclasses.dataclass(frozen=True)
class TurnReply:
    """The handler's answer to one model turn of row `row`."""

    row: int
    observation_ids: tuple[int, ...]  # appended after the model's turn; may be empty
    done: bool  # the trajectory ends after this turn
    reward: float = 0.0  # this turn's reward contribution
    status: TurnStatus = "ok"  # how the tool / environment step went (for the metrics)
    tool_call: bool = False  # the turn called a tool
    seconds: float = 0.0  # wall time the step took on the host


class TurnHandler(Protocol):
    """Answers model turns for the rows of one rollout (rows are indices into its batch).

    A handler may also have `prompt_records() -> list` (one record per row): the records with
    the prompt its environments' resets wrote; the rollout then samples from those prompts
    (envs.EnvTurnHandler has it).
    """

    def stop_sequences(self, row: int) -> Sequence[Sequence[int]]:
        """Token-id sequences that end a model turn of `row` besides EOS (may be empty)."""
        ...

    def submit(self, row: int, turn_ids: Sequence[int], ended_by: TurnEnd) -> None:
        """Hands over the model's turn (its token ids, stop sequence included); never blocks.

        Called for every turn end, the last one included ("eos" / "length"), so the handler
        can score it; the engine ends the row after an "eos" or "length" turn whatever the
        reply says.
        """
        ...

    def poll(self, timeout_s: float) -> list[TurnReply]:
        """The replies ready now; waits up to `timeout_s` seconds when none is."""
        ...


# Makes the handler of one rollout: records[i] is the record (prompt) of batch row i (each
# prompt's record repeated for its group's rows, as the reward function receives them).
HandlerFactory = Callable[[Sequence[Any]], TurnHandler]
