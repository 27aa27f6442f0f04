"""EnvTurnHandler against slow, crashing and hostile environments: submit never blocks, a
misbehaving step costs its own row (the right status, an observation saying so), hostile
output is cut and cleaned, and observations come wrapped in SmolLM2's chat template."""

from __future__ import annotations

import time

import pytest

from jaxrl4llm.envs import EnvService, register
from jaxrl4llm.rewards.pool import PoolConfig
from jaxrl4llm.sampling.turns import TurnLimits

from tests.envs import fakes

POOL = PoolConfig(num_workers=2, item_timeout_s=3.0, preload=())
for _name, _class in {
    "echo": fakes.Echo,
    "sleepy": fakes.Sleepy,
    "hostile": fakes.Hostile,
    "unpicklable": fakes.Unpicklable,
    "introduces": fakes.Introduces,
    "broken_reset": fakes.BrokenReset,
}.items():
    register(_name, _class)

# SmolLM2's template around a user turn that follows the model's, written out by hand.
BEFORE = "<|im_end|>\n<|im_start|>user\n"
AFTER = "<|im_end|>\n<|im_start|>assistant\n"


def _records(n):
    return [{"prompt": f"topic {i}", "answer": "0", "metadata": {}} for i in range(n)]


def _wait(handler, count, limit_s=30.0):
    """Polls until `count` replies came back; returns them in arrival order."""
    replies, deadline = [], time.monotonic() + limit_s
    while len(replies) < count and time.monotonic() < deadline:
        replies += handler.poll(0.2)
    assert len(replies) == count, replies
    return replies


def _text(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


@pytest.fixture
def service(smollm2_tokenizer):
    services = []

    def make(spec, limits=TurnLimits(max_turns=4, max_observation_tokens=64)):
        services.append(EnvService(spec, smollm2_tokenizer, limits=limits, pool=POOL))
        return services[-1]

    yield make
    for s in services:
        s.close()


def test_a_turn_is_answered_in_the_chat_template_and_the_third_ends_the_game(
    service, smollm2_tokenizer
):
    tok = smollm2_tokenizer
    handler = service("echo")(_records(1))
    assert handler.stop_sequences(0) and all(
        tok.decode(s).endswith("</say>") for s in handler.stop_sequences(0)
    )
    rewards = []
    for turn in range(3):
        handler.submit(0, tok.encode(f"hi {turn}</say>"), "stop")
        (reply,) = _wait(handler, 1)
        rewards.append(reply.reward)
        assert (reply.row, reply.status, reply.tool_call) == (0, "ok", False)
        if turn < 2:
            assert not reply.done
            assert _text(tok, reply.observation_ids) == f"{BEFORE}you said: hi {turn}</say>{AFTER}"
    assert reply.done and reply.observation_ids == ()
    assert rewards == [0.0, 0.0, 0.5]
    with pytest.raises(ValueError, match="the end of its trajectory"):
        handler.submit(0, tok.encode("more"), "stop")


def test_an_eos_turn_and_the_last_allowed_turn_end_the_row(service, smollm2_tokenizer):
    tok = smollm2_tokenizer
    handler = service("echo", TurnLimits(max_turns=2))(_records(2))
    handler.submit(0, tok.encode("bye"), "eos")
    handler.submit(1, tok.encode("a</say>"), "stop")
    replies = {r.row: r for r in _wait(handler, 2)}
    assert replies[0].done and replies[0].observation_ids == ()
    assert not replies[1].done and replies[1].observation_ids
    handler.submit(1, tok.encode("b</say>"), "stop")  # turn 2 of max_turns=2
    (last,) = _wait(handler, 1)
    assert last.done and last.observation_ids == ()


def test_a_slow_step_does_not_block_submit_or_the_other_rows(service, smollm2_tokenizer):
    tok = smollm2_tokenizer
    handler = service("sleepy")(_records(1)), service("echo")(_records(1))
    slow, fast = handler
    start = time.monotonic()
    slow.submit(0, tok.encode("slow</say>"), "stop")
    assert time.monotonic() - start < 0.5  # submit returned while the step sleeps 2 s
    fast.submit(0, tok.encode("fast</say>"), "stop")
    (reply,) = _wait(fast, 1, limit_s=1.5)
    assert reply.status == "ok" and slow.poll(0.0) == []  # the slow row is still running
    (late,) = _wait(slow, 1)
    assert late.status == "ok" and late.seconds >= 2.0


@pytest.mark.parametrize(
    "turn, status, says",
    [
        ("loop", "timeout", "The environment did not answer in time (3 s;"),
        ("exit", "crash", "The environment crashed: verifier worker exited with code 7"),
        ("raise", "error", "The environment failed: RuntimeError: boom"),
        ("nan", "error", "The environment failed: ValueError: step's reward must be finite"),
        ("not-a-result", "error", "The environment failed: TypeError: step returned str"),
    ],
)
def test_a_misbehaving_step_costs_its_row_only(service, smollm2_tokenizer, turn, status, says):
    tok = smollm2_tokenizer
    handler = service("hostile")(_records(2))
    handler.submit(0, tok.encode(turn), "stop")
    handler.submit(1, tok.encode("ok"), "stop")
    replies = {r.row: r for r in _wait(handler, 2)}
    assert (replies[1].status, replies[1].reward) == ("ok", 1.0)
    bad = replies[0]
    assert (bad.status, bad.reward, bad.done) == (status, 0.0, False)
    observation = _text(tok, bad.observation_ids)
    assert observation.startswith(BEFORE + says) and observation.endswith(AFTER)
    handler.submit(0, tok.encode("ok"), "stop")  # the row goes on, on a fresh worker if need be
    (again,) = _wait(handler, 1)
    assert (again.status, again.reward) == ("ok", 1.0)


def test_hostile_output_is_cut_and_cleaned(service, smollm2_tokenizer):
    tok = smollm2_tokenizer
    handler = service("hostile", TurnLimits(max_turns=4, max_observation_tokens=40))(_records(3))
    for row, turn in enumerate(("huge", "binary", "surrogates")):
        handler.submit(row, tok.encode(turn), "stop")
    replies = {r.row: r for r in _wait(handler, 3)}
    assert all(r.status == "ok" for r in replies.values())
    huge = _text(tok, replies[0].observation_ids)
    assert len(replies[0].observation_ids) == 40
    assert huge.startswith(BEFORE + "xxxx") and huge.endswith("\n[... cut]" + AFTER)
    assert _text(tok, replies[1].observation_ids) == f"{BEFORE}\ufffd\ufffdok\ufffd\ufffd{AFTER}"
    assert _text(tok, replies[2].observation_ids) == f"{BEFORE}caf\ufffd ok{AFTER}"


def test_a_failed_reset_ends_its_row_at_the_first_turn(service, smollm2_tokenizer):
    tok = smollm2_tokenizer
    for spec, says in (("broken_reset", "no such game"), ("unpicklable", "unpicklable result")):
        handler = service(spec)(_records(1))
        handler.submit(0, tok.encode("hello</say>"), "stop")
        (reply,) = _wait(handler, 1)
        assert (reply.status, reply.done, reply.observation_ids) == ("error", True, ())
        assert says in handler.rows[0].failure.value


def test_reset_text_becomes_the_prompt(service):
    records = _records(2)
    handler = service("introduces")(records)
    assert [r["prompt"] for r in handler.prompt_records()] == [
        "Let us talk about topic 0.",
        "Let us talk about topic 1.",
    ]
    assert records[0]["prompt"] == "topic 0"  # the caller's records are left alone
