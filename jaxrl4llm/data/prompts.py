"""Prompt formatting: the chat messages for a question (the models package applies the template).

The user turn is the question, a newline and one instruction: the one the run names
(--instruction), else the record's own (metadata["instruction"]: a task's answer format,
e.g. countdown's boxed expression or reasoning-gym's <answer> tags), else
DEFAULT_INSTRUCTION. Never two. A system prompt or instruction "@NAME" is NAMED_PROMPTS[NAME].
A worked example (--example: "@NAME" of NAMED_EXAMPLES, or a JSON file of chat messages) is
a past exchange placed between the system turn and the question: a small model copies a
format it sees done (a tool call and its answer) far more often than one it is told about.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from jaxrl4llm.data.records import DataError

# The "Minimalist" paper's instruction (arXiv:2504.11343), as used for Qwen2.5-Math.
DEFAULT_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
RECORD = "record"  # instruction=RECORD: the record's own instruction, else the default

NAMED_PROMPTS = {
    # Minimal-RL's system prompt (scripts/data_preprocess/numina_math.py).
    "minimalist": "Please reason step by step, and put your final answer within \\boxed{}.",
    # Logic-RL's system prompt for instruct models (examples/data_preprocess/kk.py,
    # template qwen-instruct; its example answer lists one "(i) Name is a knight" per line).
    "logic_rl": (
        "You are a helpful assistant. The assistant first thinks about the reasoning process "
        "in the mind and then provides the user with the answer. The reasoning process and "
        "answer are enclosed within <think> </think> and <answer> </answer> tags, "
        "respectively, i.e., <think> reasoning process here </think><answer> answer here "
        "</answer>.  Now the user asks you to solve a logical reasoning problem. After "
        "thinking, when you finally reach a conclusion, clearly state the identity of each "
        "character within <answer> </answer> tags. i.e., <answer> (1) Zoey is a knight\n(2) "
        "... </answer>."
    ),
}


# Worked examples: the turns of one solved question, as the model would see them in a run.
NAMED_EXAMPLES: dict[str, tuple[dict[str, str], ...]] = {
    # The calculator environment's format (envs/calculator.py): a call, its output as a tool
    # turn, then the answer.
    "calculator": (
        {"role": "user", "content": "What is 12 * 34?"},
        {"role": "assistant", "content": "<calc>12 * 34</calc>"},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": "The answer is 408."},
    ),
}


@functools.lru_cache(maxsize=8)  # a run asks once per record
def example_turns(example: str | None) -> tuple[dict[str, str], ...]:
    """The chat turns of --example: "@NAME" (NAMED_EXAMPLES), a JSON file holding a list of
    {"role", "content"} messages, or none (None / empty)."""
    if not example:
        return ()
    if example.startswith("@"):
        if example[1:] not in NAMED_EXAMPLES:
            raise DataError(
                f"--example={example}: no example named {example[1:]!r}; named examples: "
                f"{', '.join('@' + n for n in sorted(NAMED_EXAMPLES))}"
            )
        return NAMED_EXAMPLES[example[1:]]
    try:
        with open(example) as f:
            turns = json.load(f)
    except (OSError, ValueError) as exc:
        raise DataError(
            f"--example={example}: cannot read it as a JSON file ({exc}); give @NAME or the "
            "path of a JSON list of chat messages"
        ) from None
    if not (
        isinstance(turns, list)
        and turns
        and all(
            isinstance(t, dict)
            and set(t) == {"role", "content"}
            and all(isinstance(v, str) for v in t.values())
            for t in turns
        )
    ):
        raise DataError(
            f"--example={example}: expected a non-empty JSON list of "
            '{"role": ..., "content": ...} messages with string values'
        )
    return tuple(turns)


def expand(text: str | None, flag: str = "--system_prompt") -> str | None:
    """'@NAME' -> NAMED_PROMPTS[NAME]; other text as is."""
    if text and text.startswith("@"):
        if text[1:] not in NAMED_PROMPTS:
            raise DataError(
                f"{flag}={text}: no prompt named {text[1:]!r}; named prompts: "
                f"{', '.join('@' + n for n in sorted(NAMED_PROMPTS))}"
            )
        return NAMED_PROMPTS[text[1:]]
    return text


def user_content(question: str, instruction: str | None = DEFAULT_INSTRUCTION) -> str:
    """The user turn: question + "\\n" + instruction (no instruction when None or empty)."""
    return f"{question}\n{instruction}" if instruction else question


def build_messages(
    question: str,
    instruction: str | None = DEFAULT_INSTRUCTION,
    system: str | None = None,
    example: tuple[dict[str, str], ...] = (),
) -> list[dict[str, str]]:
    """[{"role": "user", "content": question + "\\n" + instruction}], after an optional system
    turn and the turns of a worked example."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.extend(dict(turn) for turn in example)
    messages.append({"role": "user", "content": user_content(question, instruction)})
    return messages


def record_instruction(record: Any, instruction: str | None = RECORD) -> str | None:
    """The instruction of a record's user turn (see the module docstring)."""
    if instruction != RECORD:
        return instruction
    metadata = (
        record.get("metadata") if isinstance(record, dict) else getattr(record, "metadata", None)
    ) or {}
    own = metadata.get("instruction")
    return DEFAULT_INSTRUCTION if own is None else own


def record_messages(
    record: Any,
    instruction: str | None = RECORD,
    system: str | None = None,
    example: tuple[dict[str, str], ...] = (),
) -> list[dict[str, str]]:
    """build_messages for a Record (or a {prompt, ...} dict); `instruction` RECORD (default):
    the record's own instruction, else DEFAULT_INSTRUCTION; None or "": none."""
    prompt = record["prompt"] if isinstance(record, dict) else record.prompt
    return build_messages(prompt, record_instruction(record, instruction), system, example)
