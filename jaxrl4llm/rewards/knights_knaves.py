"""Knights and knaves: parse "X is a knight/knave" claims from the final answer, compare.

The reference comes from the record's metadata {names, solution} (solution: one bool per name,
True = knight), or else from the claims in `record.answer` itself.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from jaxrl4llm.rewards import extract
from jaxrl4llm.rewards.base import Verdict, record_answer, record_metadata

_CLAIM_RE = re.compile(r"\b([A-Z][\w'-]*)\s+(?:is|was)\s+(?:a\s+|an\s+|the\s+)?"
                       r"(?i:(knight|knave))s?\b")


def parse_claims(text: str, names: Sequence[str] | None = None) -> dict[str, set[bool]]:
    """name -> the identities claimed for it (True = knight); a set, to expose contradictions."""
    claims: dict[str, set[bool]] = {}
    if names is None:
        for m in _CLAIM_RE.finditer(text):
            claims.setdefault(m.group(1), set()).add(m.group(2).lower() == "knight")
        return claims
    for name in names:
        pattern = re.compile(rf"\b{re.escape(name)}\s+(?:is|was)\s+(?:a\s+|an\s+|the\s+)?"
                             r"(?i:(knight|knave))s?\b")
        for m in pattern.finditer(text):
            claims.setdefault(name, set()).add(m.group(1).lower() == "knight")
    return claims


def solution_of(record: Any) -> dict[str, bool]:
    """The reference {name: is_knight} of a knights & knaves record."""
    meta: Mapping[str, Any] = record_metadata(record)
    if "names" in meta and "solution" in meta:
        return {str(n): bool(s) for n, s in zip(meta["names"], meta["solution"])}
    claims = parse_claims(extract.gold_answer(record_answer(record)))
    if not claims or any(len(v) != 1 for v in claims.values()):
        raise ValueError("knights_knaves record needs metadata {names, solution} or an answer "
                         f"like 'A is a knight, B is a knave'; got {record_answer(record)!r}")
    return {name: next(iter(v)) for name, v in claims.items()}


def final_answer(completion: str) -> str | None:
    answer = extract.extract_boxed(completion)
    return answer if answer is not None else extract.extract_answer_tag(completion)


class KnightsKnavesVerifier:
    def close(self) -> None:
        pass

    def verify_one(self, completion: str, record: Any) -> Verdict:
        solution = solution_of(record)
        answer = final_answer(completion)
        if answer is None or not answer.strip():
            return Verdict(False, "no_answer")
        claims = parse_claims(answer, list(solution))
        if not claims:
            return Verdict(False, "parse_error")
        if set(claims) != set(solution):
            return Verdict(False, "incomplete")
        ok = all(claims[name] == {identity} for name, identity in solution.items())
        return Verdict(ok, "correct" if ok else "wrong")

    def verify(self, completions: Sequence[str], records: Sequence[Any]) -> list[Verdict]:
        return [self.verify_one(c, r) for c, r in zip(completions, records)]
