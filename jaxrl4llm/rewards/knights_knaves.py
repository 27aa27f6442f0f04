"""Knights and knaves: parse "X is a knight/knave" claims from the final answer, compare.

The reference comes from the record's metadata {names, solution} (solution: one bool per name,
True = knight), or else from the claims in `record.answer` itself. An answer that hedges
(rewards/hedges.py: "maybe", "or", "?", ...) or has a role word outside its claims ("Zoey is
a knight, she is a knave", "Zoey is a knight and a knave") is wrong, whatever it claims.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any, Iterator, Mapping, Sequence

from jaxrl4llm.rewards import extract, hedges
from jaxrl4llm.rewards.base import Job, Verdict, record_answer, record_metadata, run_in_process

_WORD_RE = re.compile(r"[\w'-]+")
_ROLES = {"knight": True, "knights": True, "knave": False, "knaves": False}
_ARTICLES = ("a", "an", "the")
_VERBS = ("is", "was")
# "knight or a knave", "knight/knave", "knight (or knave)", "knight and a knave": a hedge.
_HEDGE_RE = re.compile(
    r"\s*\(?\s*(?:/|,?\s*\b(?:or|and)\b)\s*(?:(?:a|an)\s+)?(?:knight|knave)", re.IGNORECASE
)
_HEDGE_WINDOW = 40  # characters after a role word searched for a hedge (bounded: linear)


def _role_claims(text: str) -> Iterator[tuple[re.Match, re.Match, bool, bool]]:
    """(the word before the verb, the role word, is_knight, hedged) for each
    `X is [a|an|the] knight/knave`.

    One pass over the words with a window of the last four: linear in `text` (a regex with
    a free-form name before the verb rescans the rest of the text from every word start).
    """
    recent: deque[re.Match] = deque(maxlen=4)
    for word in _WORD_RE.finditer(text):
        recent.append(word)
        role = _ROLES.get(word.group().lower())
        if role is None or len(recent) < 3:
            continue
        has_article = len(recent) == 4 and recent[2].group() in _ARTICLES
        chain = list(recent)[-4:] if has_article else list(recent)[-3:]
        if chain[1].group() not in _VERBS:
            continue
        if not all(text[a.end() : b.start()].isspace() for a, b in zip(chain, chain[1:])):
            continue
        hedged = _HEDGE_RE.match(text, word.end(), word.end() + _HEDGE_WINDOW) is not None
        yield chain[0], word, role, hedged


def _ends_with_name(text: str, end: int, name: str) -> bool:
    """Whether text[:end] ends with `name` as whole words."""
    start = end - len(name)
    if start < 0 or not text.startswith(name, start):
        return False
    return start == 0 or not (text[start - 1].isalnum() or text[start - 1] in "_'-")


def _named_claims(
    text: str, names: Sequence[str] | None
) -> Iterator[tuple[str, re.Match, bool, bool]]:
    """(name, the role word, is_knight, hedged) for each claim about one of `names`; without
    `names`, a name is the capitalised word before the verb."""
    for word, role_word, role, hedged in _role_claims(text):
        if names is None:
            name = word.group().lstrip("'-")
            if name and "A" <= name[0] <= "Z":
                yield name, role_word, role, hedged
            continue
        for name in names:
            if _ends_with_name(text, word.end(), name):
                yield name, role_word, role, hedged


def parse_claims(text: str, names: Sequence[str] | None = None) -> dict[str, set[bool]]:
    """name -> the identities claimed for it (True = knight); a set, to expose contradictions.

    A hedged claim ("Zoey is a knight or a knave") claims both identities, so it is never
    credited. Without `names`, a name is the capitalised word before the verb.
    """
    claims: dict[str, set[bool]] = {}
    for name, _, role, hedged in _named_claims(text, names):
        claims.setdefault(name, set()).update({True, False} if hedged else {role})
    return claims


def hedge_of(answer: str, names: Sequence[str]) -> str | None:
    """What disqualifies `answer` whatever its claims, else None: a hedge
    (hedges.find_hedge), or a role word that is not the role of a claim about one of `names`
    ("Zoey is a knight and a knave", "she is a knave", "Zoey and Oliver are knights";
    split at every non-alphanumeric character, so "knight/knave" is two role words)."""
    found = hedges.find_hedge(answer, names)
    if found is not None:
        return found
    claimed = {role_word.start() for _, role_word, _, _ in _named_claims(answer, names)}
    return next(
        (
            word.group()
            for word in hedges.WORD_RE.finditer(answer)
            if word.group().lower() in _ROLES and word.start() not in claimed
        ),
        None,
    )


def solution_of(record: Any) -> dict[str, bool]:
    """The reference {name: is_knight} of a knights & knaves record."""
    meta: Mapping[str, Any] = record_metadata(record)
    if "names" in meta and "solution" in meta:
        return {str(n): bool(s) for n, s in zip(meta["names"], meta["solution"])}
    claims = parse_claims(extract.gold_answer(record_answer(record)))
    if not claims or any(len(v) != 1 for v in claims.values()):
        raise ValueError(
            "knights_knaves record needs metadata {names, solution} or an answer "
            f"like 'A is a knight, B is a knave'; got {record_answer(record)!r}"
        )
    return {name: next(iter(v)) for name, v in claims.items()}


def final_answer(completion: str) -> str | None:
    answer = extract.extract_boxed(completion)
    return answer if answer is not None else extract.extract_answer_tag(completion)


def verify_knights_knaves(completion: str, solution: tuple[tuple[str, bool], ...]) -> str:
    """The REASONS name for one completion against {name: is_knight} pairs (runs in a pool
    worker; linear-time string work)."""
    answer = final_answer(completion)
    if answer is None or not answer.strip():
        return "no_answer"
    reference = dict(solution)
    claims = parse_claims(answer, list(reference))
    if not claims:
        return "parse_error"
    if set(claims) != set(reference):
        return "incomplete"
    if hedge_of(answer, list(reference)) is not None:
        return "wrong"
    ok = all(claims[name] == {identity} for name, identity in reference.items())
    return "correct" if ok else "wrong"


class KnightsKnavesVerifier:
    def job(self, completion: str, record: Any) -> Job:
        """The pool job for one completion; a record without a solution raises here."""
        return Job(verify_knights_knaves, (completion, tuple(solution_of(record).items())))

    def verify_one(self, completion: str, record: Any) -> Verdict:
        return run_in_process(self.job(completion, record))

    def answer_key(self, completion: str, record: Any) -> str | None:
        """The answer maj@k votes on: the claims per inhabitant, sorted by name; a hedged
        answer's key says so, so that it never shares a vote with a plain answer."""
        answer = final_answer(completion)
        if not answer:
            return None
        names = list(solution_of(record))
        claims = parse_claims(answer, names)
        if not claims:
            return None
        key = ", ".join(
            f"{name}={'/'.join(sorted('knight' if k else 'knave' for k in roles))}"
            for name, roles in sorted(claims.items())
        )
        return key + " (hedged)" if hedge_of(answer, names) is not None else key

    def plan(self, completions: Sequence[str], records: Sequence[Any]) -> list[Verdict | Job]:
        return [self.job(c, r) for c, r in zip(completions, records)]
