"""Prompt formatting: the chat messages for a question (the models package applies the template).

The user turn is the question, a newline and one instruction: the one the run names
(--instruction), else the record's own (metadata["instruction"]: a task's answer format,
e.g. countdown's boxed expression or reasoning-gym's <answer> tags), else
DEFAULT_INSTRUCTION. Never two. A system prompt or instruction "@NAME" is NAMED_PROMPTS[NAME].
"""

from __future__ import annotations

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
    question: str, instruction: str | None = DEFAULT_INSTRUCTION, system: str | None = None
) -> list[dict[str, str]]:
    """[{"role": "user", "content": question + "\\n" + instruction}], after an optional system
    turn."""
    messages = [{"role": "system", "content": system}] if system else []
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
    record: Any, instruction: str | None = RECORD, system: str | None = None
) -> list[dict[str, str]]:
    """build_messages for a Record (or a {prompt, ...} dict); `instruction` RECORD (default):
    the record's own instruction, else DEFAULT_INSTRUCTION; None or "": none."""
    prompt = record["prompt"] if isinstance(record, dict) else record.prompt
    return build_messages(prompt, record_instruction(record, instruction), system)
