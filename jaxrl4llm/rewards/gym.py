"""reasoning-gym tasks: each task's own `score_answer`, run as a job in the verifier pool.

A record from a `gym:` source (data/gym.py) carries its task, its config (JSON) and its
reasoning-gym entry (pickled) in metadata. The answer is the last <answer>...</answer> of the
completion (reasoning-gym's convention), else the last \\boxed{}. In a pool worker the task's
dataset is rebuilt from its config once per worker (cached) and scores the answer; only a
full score (1.0) is "correct": reasoning-gym's partial credits (e.g. 0.01 for a wrong
number, 0.3 + 0.7 * matched / people in knights_knaves) count as "wrong", so every task has
the same binary reward as math. A knights_knaves answer that hedges or gives one person two
roles is "wrong" before reasoning-gym's scorer sees it (rewards/hedges.py): that scorer
credits "Zoey is a knight, maybe" and reads "Zoey is a knave and a knight" as a knave.

Untrusted text and reasoning-gym scorers: several scorers pass the answer to sympy's
`parse_expr`, which evaluates Python. countdown is therefore scored by our own countdown
verifier (an AST walker, never eval; every number used, as reasoning-gym's question asks);
knights_knaves and gsm_symbolic scorers do string and number work only; for every other task
an answer that names a dunder or calls a Python builtin is refused as a parse_error before a
scorer sees it. The pool isolates hangs, crashes and memory blow-ups, not malicious code.
"""

from __future__ import annotations

import functools
import json
import pickle
import re
from typing import Any

from jaxrl4llm.rewards import extract, hedges
from jaxrl4llm.rewards.base import Job, PlansPerCompletion, Verdict, record_metadata
from jaxrl4llm.rewards.countdown import CountdownConfig, CountdownVerifier

MAX_ANSWER_CHARS = 2000
# Scorers read by hand: string / regex / float work only.
PLAIN_SCORERS = ("knights_knaves", "gsm_symbolic")
# A dunder, or a call of a Python builtin (sympy's parse_expr keeps builtins callable).
_UNSAFE_RE = re.compile(
    r"__|\b(?:open|exec|eval|compile|getattr|setattr|delattr|globals|locals|vars|input|"
    r"breakpoint|exit|quit|help|memoryview|dir|type|super|object|print)\s*\("
)


def gym_answer(completion: str) -> str | None:
    """The final answer: the last <answer> tag, else the last \\boxed{}."""
    answer = extract.extract_answer_tag(completion)
    return answer if answer is not None else extract.extract_boxed(completion)


@functools.lru_cache(maxsize=32)
def _dataset(task: str, config_json: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(task, **json.loads(config_json))


def score_gym_answer(answer: str, task: str, config_json: str, entry_pickle: bytes) -> str:
    """Runs in a pool worker: "correct" iff reasoning-gym's score is 1.0, else "wrong"; a
    knights_knaves hedge or second role (hedges.gym_hedge) is "wrong" unscored."""
    entry = pickle.loads(entry_pickle)
    if (
        task == "knights_knaves"
        and hedges.gym_hedge(answer, entry.get("metadata", {}).get("names", ())) is not None
    ):
        return "wrong"
    score = float(_dataset(task, config_json).score_answer(answer, entry))
    return "correct" if score >= 1.0 - 1e-9 else "wrong"


class GymVerifier(PlansPerCompletion):
    def __init__(self):
        self.countdown = CountdownVerifier(CountdownConfig(use_all=True))

    def plan_one(self, completion: str, record: Any) -> Verdict | Job:
        meta = record_metadata(record)
        try:
            task, config_json, entry = meta["gym_task"], meta["gym_config"], meta["gym_entry"]
        except KeyError as exc:
            raise ValueError(
                f"a gym record needs metadata gym_task, gym_config and gym_entry "
                f"(from a gym: source); missing {exc}"
            ) from None
        if task == "countdown":  # sympy parse_expr in reasoning-gym's scorer: ours instead
            problem = pickle.loads(entry)["metadata"]
            return self.countdown.job(completion, {"metadata": problem, "answer": ""})
        answer = gym_answer(completion)
        if answer is None or not answer.strip():
            return Verdict(False, "no_answer")
        if len(answer) > MAX_ANSWER_CHARS or (
            task not in PLAIN_SCORERS and _UNSAFE_RE.search(answer)
        ):
            return Verdict(False, "parse_error")
        return Job(score_gym_answer, (answer, task, config_json, entry))

    def answer_key(self, completion: str, record: Any) -> str | None:
        """The answer maj@k votes on: whitespace-collapsed, case-folded."""
        answer = gym_answer(completion)
        return " ".join(answer.split()).casefold() or None if answer else None
