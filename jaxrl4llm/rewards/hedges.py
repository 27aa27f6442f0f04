"""Hedges in a knights-and-knaves answer: what leaves a person's role open or gives two roles.

Shared by our knights-and-knaves verifier and the reasoning-gym knights_knaves path. A policy
that may write "Zoey is a knight (or maybe a knave)" and be credited learns to hedge, so a
final answer that contains a hedge word or phrase, or a question mark, is never correct,
whatever roles it names. Linear-time: one pass over the words and one literal-phrase search.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Iterable

# Whole words, case-insensitive (a word that is one of the puzzle's names is exempt).
HEDGE_WORDS = frozenset(
    """
    or either neither nor maybe perhaps possibly probably likely unlikely
    might may could if unless otherwise else whether alternatively assuming supposing
    depends depending uncertain unsure unclear unknown unknowable undetermined
    undeterminable indeterminate undecided undecidable ambiguous inconclusive presumably
    supposedly apparently seemingly seems guess
""".split()
)
# Phrases over the answer's words (lower-cased, joined by one space).
HEDGE_PHRASES = (
    "not sure",
    "not certain",
    "not clear",
    "not known",
    "not determined",
    "no idea",
    "don t know",
    "dont know",
    "do not know",
    "can t tell",
    "cannot tell",
    "can t say",
    "cannot say",
    "cannot be determined",
    "can t be determined",
    "can be",
    "hard to say",
    "hard to tell",
    "not enough information",
    "insufficient information",
)
QUESTION_MARKS = "?\u00bf"  # and, after NFKC, full-width ? and the doubled ?? ?! !?

# reasoning-gym's role words: its seven pairs (knight/knave, hero/villain, ...); its scorer
# reads any of them as a role.
GYM_ROLES = frozenset(
    {
        "knight",
        "knave",
        "pioneer",
        "laggard",
        "saint",
        "sinner",
        "hero",
        "villain",
        "angel",
        "devil",
        "altruist",
        "egoist",
        "sage",
        "fool",
    }
)
# Words reasoning-gym's scorer skips between a name and its role.
GYM_SKIPPED = frozenset({"is", "a", "an"})

# Letters and digits: "knight/knave", "knight-knave" and "knight_knave" are two words.
WORD_RE = re.compile(r"[^\W_]+")
_PHRASE_RE = re.compile(r"\b(?:" + "|".join(map(re.escape, HEDGE_PHRASES)) + r")\b")


def find_hedge(answer: str, names: Iterable[str] = ()) -> str | None:
    """The first hedge in `answer` (a hedge word or phrase, or a question mark), else None.
    Read after NFKC normalisation, so full-width and other compatibility forms ("ｏｒ") count."""
    answer = unicodedata.normalize("NFKC", answer)
    mark = next((c for c in answer if c in QUESTION_MARKS), None)
    if mark is not None:
        return mark
    exempt = {w.lower() for name in names for w in WORD_RE.findall(name)}
    words = [w.lower() for w in WORD_RE.findall(answer)]
    hedge = next((w for w in words if w in HEDGE_WORDS and w not in exempt), None)
    if hedge is not None:
        return hedge
    phrase = _PHRASE_RE.search(" ".join(words))
    return phrase.group() if phrase is not None else None


def _gym_role_reads(answer: str) -> int:
    """How many role words reasoning-gym's knights_knaves scorer reads as a person's role.

    Its `_normalize_answer`, step by step: lower-case; ". , ( )" to spaces; " and " to a
    space; split at whitespace; skip "is", "a", "an"; a role word gives the last other word
    its role, and a role word after a role word (no other word between) is dropped.
    """
    text = answer.lower()
    for mark in ".,()":
        text = text.replace(mark, " ")
    reads, named = 0, False
    for token in text.replace(" and ", " ").split():
        if token in GYM_SKIPPED:
            continue
        if token in GYM_ROLES:
            reads += named
            named = False
        else:
            named = True
    return reads


def gym_unread_roles(answer: str) -> int:
    """How many role words (and plurals) reasoning-gym's scorer does not read as some
    person's role. That scorer credits an answer whose (name, role) pairs equal the
    reference's, and it drops what it does not read: a second role ("Zoey is a knave and a
    knight" scores as a knave), a role glued to a mark ("Zoey: knave!", "knave/knight") or a
    plural ("all of them are knaves"). With every role word read, a second role for one
    person is an extra pair, which that scorer marks wrong.
    """
    roles = [
        w
        for w in WORD_RE.findall(answer.lower())
        if w in GYM_ROLES
        or (w[-1] == "s" and w[:-1] in GYM_ROLES)
        or (w[-2:] == "es" and w[:-2] in GYM_ROLES)
    ]  # knights, heroes
    return len(roles) - _gym_role_reads(answer)


def gym_hedge(answer: str, names: Iterable[str] = ()) -> str | None:
    """What disqualifies a reasoning-gym knights_knaves answer, else None: a hedge, or a role
    word that its scorer does not read (gym_unread_roles)."""
    unread = gym_unread_roles(answer)
    return find_hedge(answer, names) or (f"{unread} unread role word(s)" if unread else None)
