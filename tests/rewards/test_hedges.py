"""A hedged or self-contradicting knights-and-knaves answer is never correct, in our verifier
and on the reasoning-gym path; plain answers in every accepted layout still are."""

from __future__ import annotations

import json
import pickle
import time

import pytest

from jaxrl4llm.data.records import Record
from jaxrl4llm.rewards import hedges
from jaxrl4llm.rewards.knights_knaves import KnightsKnavesVerifier, hedge_of

NAMES, SOLUTION = ["Zoey", "Oliver", "Emma"], [True, False, True]
RECORD = Record(
    "q",
    "Zoey is a knight, Oliver is a knave, Emma is a knight",
    {"task": "knights_knaves", "names": NAMES, "solution": SOLUTION},
)

# {a}: one person, {r}: their role, {o}: the other role, {rest}: the others' right claims.
HEDGED = [
    "{a} is a {r} (or maybe a {o}), {rest}",
    "{a} is a {r} (perhaps a {o}), {rest}",
    "{a} is a {r} and a {o}, {rest}",
    "{a} is a {o} and a {r}, {rest}",
    "{a} is a {r}/{o}, {rest}",
    "{a} is a {r} / {o}, {rest}",
    "{a} is a {r} /{o}, {rest}",
    "{a} is a {r} or {o}, {rest}",
    "{a} is either a {r} or a {o}, {rest}",
    "{a} is a {r}-or-{o}, {rest}",
    "{a} is a {r}, maybe, {rest}",
    "{a} is a {r}?, {rest}",
    "{a} is a {r} (?), {rest}",
    "{a} is a {r}, possibly, {rest}",
    "{a} is a {r}, probably, {rest}",
    "{a} is a {r} (not sure), {rest}",
    "{a} is a {r} (can't tell), {rest}",
    "{a} is a {r}, I don't know, {rest}",
    "{a} is a {r} or not, {rest}",
    "{a} is a {r}; might be a {o}, {rest}",
    "{a} is a {r}, could be a {o}, {rest}",
    "{a} is a {r} (unknown), {rest}",
    "{a} is a {r} (undetermined), {rest}",
    "{a} is a {r}, unless {a} is a {o}, {rest}",
    "{a} is a {r}, she is a {o}, {rest}",
    "{a} is a {r} & a {o}, {rest}",
    "{a} is a {r} as well as a {o}, {rest}",
    "{a} is a {r}, {a} is a {o}, {rest}",
    "{a} is a {r}, {rest}. Or the reverse.",
    "{a} is a {r}, {rest} (if not, the reverse)",
    "{a} is a {r}, {rest}. All of them are {o}s.",
    "{a} is a {r}, {rest}, {a}: {o}!",
    "{a} is a {r}, {rest}, and everyone else is a {o}",
    "{a} is a {R}? {rest}",
]
# reasoning-gym's own scorer gives these full marks (checked below with the library).
GYM_CREDITS = [
    "{a} is a {r} and a {o}, {rest}",
    "{a} is a {r} /{o}, {rest}",
    "{a} is a {r}, maybe, {rest}",
    "{a} is a {r}, possibly, {rest}",
    "{a} is a {r} or not, {rest}",
    "{a} is a {r}, {rest}. All of them are {o}s.",
    "{a} is a {r}, {rest}, {a}: {o}!",
]


def _role(is_knight: bool) -> str:
    return "knight" if is_knight else "knave"


def hedged_answer(form: str, names, solution, person: int) -> str:
    """`form` about names[person], the others' claims right."""
    rest = ", ".join(
        f"{n} is a {_role(s)}" for i, (n, s) in enumerate(zip(names, solution)) if i != person
    )
    role = _role(solution[person])
    return form.format(
        a=names[person], r=role, R=role.upper(), o=_role(not solution[person]), rest=rest
    )


@pytest.mark.parametrize("person", [0, 1])  # a knight and a knave
@pytest.mark.parametrize("form", HEDGED)
def test_our_verifier_never_credits_a_hedge(form, person):
    answer = hedged_answer(form, NAMES, SOLUTION, person)
    plain = hedged_answer("{a} is a {r}, {rest}", NAMES, SOLUTION, person)
    verifier = KnightsKnavesVerifier()
    assert verifier.verify_one(f"\\boxed{{{plain}}}", RECORD).correct
    for completion in (f"\\boxed{{{answer}}}", f"<answer>{answer}</answer>"):
        assert tuple(verifier.verify_one(completion, RECORD))[:2] in {
            (False, "wrong"),
            (False, "incomplete"),
        }


@pytest.mark.parametrize(
    "completion",
    [
        "\\boxed{Zoey is a knight, Oliver is a knave, Emma is a knight}",
        "\\boxed{Emma is a Knight; Oliver is a KNAVE. Zoey is a knight}",
        "<answer>(1) Zoey is a knight\n(2) Oliver is a knave\n(3) Emma is a knight</answer>",
        "<answer>\n(1) Zoey is a knight\n(2) Oliver is a knave\n(3) Emma is a knight\n</answer>",
        "<answer>Zoey is a knight, Oliver is a knave, and Emma is a knight.</answer>",
        "<answer>Zoey is a knight and Oliver is a knave and Emma is a knight</answer>",
        "<answer>Zoey was a knight. Oliver was a knave. Emma was a knight.</answer>",
        "\\boxed{Zoey is the knight, Oliver is the knave, Emma is the knight}",
        "\\boxed{\\text{Zoey is a knight, Oliver is a knave, Emma is a knight}}",
        "\\boxed{Zoey is a knight, Oliver is a knave, Emma is a knight, Zoey is a knight}",
        "The answer: \\boxed{Zoey is a knight, Oliver is a knave, Emma is a knight.}",
    ],
)
def test_plain_answers_stay_correct(completion):
    assert tuple(KnightsKnavesVerifier().verify_one(completion, RECORD))[:2] == (True, "correct")


def test_a_name_that_is_a_hedge_word_is_not_a_hedge():
    record = Record("q", "", {"names": ["May", "Will"], "solution": [True, False]})
    verifier = KnightsKnavesVerifier()
    assert verifier.verify_one("\\boxed{May is a knight, Will is a knave}", record).correct
    assert not verifier.verify_one(
        "\\boxed{May is a knight, Will may be a knave}", record
    ).correct  # "may" is a name only once
    assert hedges.find_hedge("may is a knight", ["May"]) is None
    assert hedges.find_hedge("Zoey may be a knight", ["Zoey"]) == "may"


def test_what_each_check_finds():
    assert hedges.find_hedge("Zoey is a knight, I'm not sure") == "not sure"
    assert hedges.find_hedge("Zoey is a knight\uff1f") == "?"  # NFKC: full-width
    assert hedges.find_hedge("Zoey is a knight (\uff4f\uff52 a knave)") == "or"
    assert hedges.find_hedge("Zoey is a knight\u2049") == "?"
    assert hedges.find_hedge("Zoey is a knight, Oliver is a knave") is None
    assert hedge_of("Zoey is a knight and Oliver is a knave", NAMES) is None
    assert hedge_of("Zoey is a knight, not a knave", NAMES) == "knave"  # a role outside claims
    assert hedge_of("Zoey and Emma are knights", NAMES) == "knights"
    gym_plain = "Zoey is a knight, Oliver is a knave, and Emma is a knight."
    assert hedges.gym_unread_roles(gym_plain) == 0
    assert hedges.gym_unread_roles("Zoey is a knave and a knight and a knave") == 2
    assert hedges.gym_unread_roles("Zoey is a hero, all heroes") == 1  # every pair's words


def test_hedged_answers_never_share_a_majority_vote_with_plain_ones():
    verifier = KnightsKnavesVerifier()
    plain = verifier.answer_key(
        "\\boxed{Zoey is a knight, Oliver is a knave, Emma is a knight}", RECORD
    )
    hedged = verifier.answer_key(
        "\\boxed{Zoey is a knight, Oliver is a knave, Emma is a knight, maybe}", RECORD
    )
    assert plain == "Emma=knight, Oliver=knave, Zoey=knight"
    assert hedged == plain + " (hedged)"


def test_the_checks_are_linear_on_1mib_floods():
    size = 1 << 20
    for unit in (
        "Zoey is a knight ",
        "knight ",
        "or ",
        "not ",
        "Zoey is a knight or a ",
        "knight/",
        "(",
        "a",
        "Zoey-",
        "can t ",
    ):
        text = (unit * (size // len(unit) + 1))[:size]
        start = time.perf_counter()
        hedge_of(text, NAMES)
        hedges.gym_hedge(text, NAMES)
        hedges.gym_unread_roles(text)
        assert time.perf_counter() - start < 30, unit  # quadratic would take hours


# --- the reasoning-gym path (GymVerifier: our check, then reasoning-gym's score_answer) ----


@pytest.fixture(scope="module")
def gym_records():
    pytest.importorskip("reasoning_gym")
    from jaxrl4llm.data.sources import make_source

    return list(make_source("gym:knights_knaves?n_people=3&n=3", "train"))


def _names_solution(record):
    meta = pickle.loads(record.metadata["gym_entry"])["metadata"]
    return meta["names"], meta["solution"]


def test_gym_roles_are_reasoning_gyms():
    logic = pytest.importorskip("reasoning_gym.logic.knights_knaves")
    assert hedges.GYM_ROLES == logic.VALID_ROLES


@pytest.mark.parametrize("form", HEDGED)
def test_gym_path_never_credits_a_hedge(form, gym_records):
    from jaxrl4llm.rewards.gym import GymVerifier

    verifier = GymVerifier()
    for record in gym_records:
        names, solution = _names_solution(record)
        assert verifier.verify_one(f"<answer>{record.answer}</answer>", record).correct
        for person in range(len(names)):
            answer = hedged_answer(form, names, solution, person)
            assert tuple(verifier.verify_one(f"<answer>{answer}</answer>", record))[:2] == (
                False,
                "wrong",
            ), answer


@pytest.mark.parametrize("form", GYM_CREDITS)
def test_reasoning_gym_alone_credits_these_hedges(form, gym_records):
    import reasoning_gym

    from jaxrl4llm.rewards.gym import score_gym_answer

    record = gym_records[0]
    names, solution = _names_solution(record)
    answer = hedged_answer(form, names, solution, 0)
    config, entry = record.metadata["gym_config"], record.metadata["gym_entry"]
    dataset = reasoning_gym.create_dataset("knights_knaves", **json.loads(config))
    assert dataset.score_answer(answer, pickle.loads(entry)) == 1.0
    assert score_gym_answer(answer, "knights_knaves", config, entry) == "wrong"


def test_gym_plain_layouts_stay_correct(gym_records):
    from jaxrl4llm.rewards.gym import GymVerifier

    verifier = GymVerifier()
    for record in gym_records:
        names, solution = _names_solution(record)
        claims = [f"{n} is a {_role(s)}" for n, s in zip(names, solution)]
        for answer in (
            record.answer,
            record.answer.upper(),
            f"  {record.answer}  ",
            ", ".join(claims),
            " and ".join(claims),
            "\n".join(f"({i + 1}) {c}" for i, c in enumerate(claims)),
            ". ".join(reversed(claims)) + ".",
        ):
            assert tuple(verifier.verify_one(f"<answer>{answer}</answer>", record))[:2] == (
                True,
                "correct",
            ), answer
        assert verifier.verify_one(f"\\boxed{{{record.answer}}}", record).correct
