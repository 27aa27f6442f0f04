"""docs/environments.md's example environment, as written there, run through the handler."""

from __future__ import annotations

import os
import time

from jaxrl4llm.envs import EnvService
from jaxrl4llm.envs.base import StepResult
from jaxrl4llm.rewards.pool import PoolConfig
from jaxrl4llm.sampling.turns import TurnLimits

from tests.envs.example_env import LetterCounter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORD = {"prompt": "How many letters has strawberry?", "answer": "10", "metadata": {}}


def test_the_docs_show_the_example_verbatim_in_under_30_lines():
    with open(os.path.join(REPO, "tests", "envs", "example_env.py")) as f:
        code = f.read()
    with open(os.path.join(REPO, "docs", "environments.md")) as f:
        assert f"```python\n{code}```" in f.read()
    assert len([line for line in code.splitlines() if line.strip()]) < 30


def test_the_example_steps():
    env = LetterCounter()
    env.reset(RECORD)
    assert env.step("Count: <count> strawberry </count>") == StepResult("10", tool_call=True)
    assert env.step("It has \\boxed{10} letters.") == StepResult(reward=1.0, done=True)


def test_the_example_through_the_handler(smollm2_tokenizer):
    tok = smollm2_tokenizer
    pool = PoolConfig(num_workers=1, preload=())
    with EnvService("letters?max_calls=1", tok, limits=TurnLimits(max_turns=3), pool=pool) as s:
        handler = s([RECORD])
        replies = []
        for turn, end in (("<count>strawberry</count>", "stop"), ("\\boxed{10}", "eos")):
            handler.submit(0, tok.encode(turn), end)
            deadline = time.monotonic() + 30
            while len(replies) < (1 if end == "stop" else 2) and time.monotonic() < deadline:
                replies += handler.poll(0.2)
    call, answer = replies
    assert tok.decode(call.observation_ids, skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>tool\n10<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (call.tool_call, call.done, answer.reward, answer.done) == (True, False, 1.0, True)
