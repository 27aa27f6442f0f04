"""Output-format checks used by reward schemes (linear-time string work on untrusted text).

Logic-RL (Xie et al. 2025, arXiv:2502.14768; github.com/Unakar/Logic-RL,
verl/utils/reward_score/kk.py `validate_response_structure`): a response is well formed when
each of <think>, </think>, <answer>, </answer> appears exactly once and in that order.
Logic-RL prefills "<think>" at the end of its prompt and checks prompt + response; this
trainer does not prefill, so the completion itself must open with its own <think>.
"""

from __future__ import annotations

THINK_ANSWER_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def think_answer_format(completion: str) -> bool:
    """<think>...</think> ... <answer>...</answer>, each tag once and in this order."""
    if any(completion.count(tag) != 1 for tag in THINK_ANSWER_TAGS):
        return False
    positions = [completion.find(tag) for tag in THINK_ANSWER_TAGS]
    return positions == sorted(positions)
