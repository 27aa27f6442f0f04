"""Prompt formatting: the chat messages for a question (the models package applies the template)."""
from __future__ import annotations

from typing import Any

# The "Minimalist" paper's instruction (arXiv:2504.11343), as used for Qwen2.5-Math.
DEFAULT_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def user_content(question: str, instruction: str | None = DEFAULT_INSTRUCTION) -> str:
    """The user turn: question + "\\n" + instruction (no instruction when None or empty)."""
    return f"{question}\n{instruction}" if instruction else question


def build_messages(question: str, instruction: str | None = DEFAULT_INSTRUCTION,
                   system: str | None = None) -> list[dict[str, str]]:
    """[{"role": "user", "content": question + "\\n" + instruction}], after an optional system
    turn."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user_content(question, instruction)})
    return messages


def record_messages(record: Any, instruction: str | None = DEFAULT_INSTRUCTION,
                    system: str | None = None) -> list[dict[str, str]]:
    """build_messages for a Record (or a {prompt, ...} dict)."""
    prompt = record["prompt"] if isinstance(record, dict) else record.prompt
    return build_messages(prompt, instruction, system)
