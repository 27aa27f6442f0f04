from __future__ import annotations

from jaxrl4llm.data.prompts import DEFAULT_INSTRUCTION, build_messages, record_messages
from jaxrl4llm.data.records import Record


def test_default_instruction_and_messages():
    assert DEFAULT_INSTRUCTION == ("Let's think step by step and output the final answer "
                                   "within \\boxed{}.")
    assert build_messages("What is 1 + 1?") == [
        {"role": "user", "content": "What is 1 + 1?\n" + DEFAULT_INSTRUCTION}]


def test_custom_instruction_and_system_turn():
    messages = build_messages("Q", instruction="Answer briefly.", system="You are terse.")
    assert messages == [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": "Q\nAnswer briefly."}]
    assert record_messages(Record("Q", "1"), instruction=None) == [{"role": "user", "content": "Q"}]
