from __future__ import annotations

from jaxrl4llm.data.prompts import DEFAULT_INSTRUCTION, build_messages, record_messages
from jaxrl4llm.data.records import Record


def test_default_instruction_and_messages():
    assert DEFAULT_INSTRUCTION == (
        "Let's think step by step and output the final answer within \\boxed{}."
    )
    assert build_messages("What is 1 + 1?") == [
        {"role": "user", "content": "What is 1 + 1?\n" + DEFAULT_INSTRUCTION}
    ]


def test_custom_instruction_and_system_turn():
    messages = build_messages("Q", instruction="Answer briefly.", system="You are terse.")
    assert messages == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Q\nAnswer briefly."},
    ]
    assert record_messages(Record("Q", "1"), instruction=None) == [{"role": "user", "content": "Q"}]


def test_one_instruction_the_runs_else_the_records_else_the_default():
    import pytest

    from jaxrl4llm.data.config import DataConfig
    from jaxrl4llm.data.records import DataError

    own = Record("Q", "1", {"instruction": "Answer in <answer> tags."})
    plain = Record("Q", "1")
    assert DataConfig().messages(own) == [
        {"role": "user", "content": "Q\nAnswer in <answer> tags."}
    ]
    assert DataConfig().messages(plain)[0]["content"] == "Q\n" + DEFAULT_INSTRUCTION
    assert DataConfig(instruction="Be brief.").messages(own)[0]["content"] == "Q\nBe brief."
    assert DataConfig(instruction="").messages(own)[0]["content"] == "Q"
    system = DataConfig(system_prompt="@minimalist").messages(plain)[0]
    assert system == {
        "role": "system",
        "content": "Please reason step by step, and put your final answer within \\boxed{}.",
    }
    logic = DataConfig(system_prompt="@logic_rl").messages(plain)[0]["content"]
    assert "<think> </think>" in logic and "(1) Zoey is a knight" in logic
    with pytest.raises(DataError, match="--system_prompt=@nope: no prompt named 'nope'"):
        DataConfig(system_prompt="@nope").messages(plain)
