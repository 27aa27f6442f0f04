"""DataConfig: where a run's prompts come from and how a record becomes chat messages (the
`data` group of the training config; the evaluator and the sampling context read it too)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl4llm.data import prompts
from jaxrl4llm.data.prompts import record_messages


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from and how a record becomes chat messages.

    source: Prompt source: a registered name (gsm8k, math500, numina_math, ...; see
        docs/data.md), hf:OWNER/NAME[:CONFIG][@SPLIT], gym:TASK?opts (reasoning-gym),
        synthetic:TASK?opts, jsonl:PATH, parquet:PATH or tfds:NAME ({split} in a path is
        replaced by the split).
    revision: Hub revision (branch, tag or commit) of an hf: source or registered name
        (default: main).
    prompt_field: Column holding the question (default: auto-detect problem, question, prompt;
        registered names and gym tasks bring their own).
    answer_field: Column holding the reference answer (default: auto-detect answer, solution).
    instruction: Instruction appended to each question (default: the record's own, e.g. a
        task's answer format, else the boxed-answer instruction of the Minimalist paper;
        empty: none; @NAME: a named prompt).
    system_prompt: Optional system turn (@minimalist, @logic_rl: the papers' prompts).
    example: A worked example before each question, after the system turn: @NAME (@calculator:
        a calculator call, its output and the answer) or a JSON file of chat messages.
    """

    source: str = "synthetic:arithmetic"
    revision: str | None = None
    prompt_field: str | None = None
    answer_field: str | None = None
    instruction: str | None = None
    system_prompt: str | None = None
    example: str | None = None

    @property
    def field_names(self) -> dict[str, str]:
        """make_source keyword arguments for the prompt / answer columns the user named."""
        names = {"prompt_field": self.prompt_field, "answer_field": self.answer_field}
        return {k: v for k, v in names.items() if v}

    def messages(self, record: Any) -> list[dict[str, str]]:
        """The chat messages of one record (instruction and system turn applied)."""
        instruction = (
            prompts.RECORD
            if self.instruction is None
            else prompts.expand(self.instruction, "--instruction")
        )
        return record_messages(
            record,
            instruction=instruction,
            system=prompts.expand(self.system_prompt),
            example=prompts.example_turns(self.example),
        )
