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


def test_example_turns_sit_between_the_system_turn_and_the_question(tmp_path):
    import json

    from jaxrl4llm.data.config import DataConfig

    turns = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    path = tmp_path / "example.json"
    path.write_text(json.dumps(turns))
    config = DataConfig(instruction="", system_prompt="Be brief.", example=str(path))
    assert config.messages(Record("What is 3 + 5?", "8")) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "What is 3 + 5?"},
    ]
    assert DataConfig(instruction="").messages(Record("Q", "1")) == [
        {"role": "user", "content": "Q"}
    ]


def test_calculator_example_is_a_call_the_calculator_answers_as_shown():
    from jaxrl4llm.data.config import DataConfig
    from jaxrl4llm.envs.calculator import CalculatorEnvironment
    from jaxrl4llm.rewards.registry import RewardConfig

    messages = DataConfig(instruction="", example="@calculator").messages(Record("Q", "1"))
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user"]
    env = CalculatorEnvironment(reward=RewardConfig(answer_mode="lenient"))  # the quickstart's
    env.reset(Record("What is 12 * 34?", "408"))
    step = env.step(messages[1]["content"])
    assert step.tool_call and step.observation == messages[2]["content"] == str(12 * 34)
    final = env.step(messages[3]["content"])  # right by the run's verifier
    assert final.done and final.reward == 1.0


def test_bad_examples_name_the_flag_and_the_fix(tmp_path):
    import pytest

    from jaxrl4llm.data.prompts import example_turns
    from jaxrl4llm.data.records import DataError

    with pytest.raises(DataError, match="--example=@nope: no example named 'nope'.*@calculator"):
        example_turns("@nope")
    with pytest.raises(DataError, match="cannot read it as a JSON file"):
        example_turns(str(tmp_path / "missing.json"))
    for bad in ("[]", '{"role": "user"}', '[{"role": "user"}]', '[{"role": "user", "content": 1}]'):
        path = tmp_path / "bad.json"
        path.write_text(bad)
        example_turns.cache_clear()
        with pytest.raises(DataError, match="expected a non-empty JSON list"):
            example_turns(str(path))
