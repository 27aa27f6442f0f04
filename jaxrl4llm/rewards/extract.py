"""Answer extraction from untrusted model text: pure string functions, linear time.

Nothing here evaluates anything; these only cut substrings out and normalize them.
"""

from __future__ import annotations

import re
import unicodedata
from fractions import Fraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\b")
_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.DOTALL)
_ANSWER_TAG_RE = re.compile(r"<(/?)answer>", re.IGNORECASE)
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL_RE = re.compile(r"[+-]?\d{1,200}(?:\.\d{1,200})?")
_INT_RE = re.compile(r"[+-]?\d{1,200}")
_SUPERSCRIPTS = str.maketrans(
    {
        "⁰": "^0",
        "¹": "^1",
        "²": "^2",
        "³": "^3",
        "⁴": "^4",
        "⁵": "^5",
        "⁶": "^6",
        "⁷": "^7",
        "⁸": "^8",
        "⁹": "^9",
    }
)
_UNICODE_OPS = {
    "⁄": "/",
    "−": "-",
    "–": "-",
    "×": "\\times ",
    "÷": "\\div ",
    "·": "\\cdot ",
    "√": "\\sqrt ",
    "∞": "\\infty ",
    "≤": "\\le ",
    "≥": "\\ge ",
    "≠": "\\ne ",
}
# Spacing / sizing macros that never change the value; removed only for the exact-match fast path.
_NOISE_RE = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |\\displaystyle|\s+")


def _brace_matches(text: str) -> dict[int, int]:
    """Maps each '{' index to its matching '}' index; escaped braces (\\{) are skipped."""
    stack, matches = [], {}
    for m in _BRACE_TOKEN_RE.finditer(text):
        token = m.group()
        if token == "{":
            stack.append(m.start())
        elif token == "}" and stack:
            matches[stack.pop()] = m.start()
    return matches


def extract_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...} (or \\fbox{...}) in `text`, else None.

    Nested braces are matched; an unclosed last box (a truncated completion) falls back to the
    previous complete one. `\\boxed 5` (no braces) gives "5".
    """
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    if not starts:
        return None
    matches = None
    for start in reversed(starts):
        rest = text[start : start + 1]
        if rest == "{":
            matches = _brace_matches(text) if matches is None else matches
            if start in matches:
                return text[start + 1 : matches[start]].strip()
        elif rest == " ":
            token = re.match(r" +([^\s$]+)", text[start : start + 200])
            if token:
                return token.group(1)
    return None


def extract_answer_tag(text: str) -> str | None:
    """Content of the last <answer>...</answer>, else None.

    One pass over the tags (a lazy `<answer>(.*?)</answer>` regex is quadratic on many opening
    tags without a closing one). Pairs as that regex would: an opening tag inside an open
    answer is content, a closing tag without an opening one is ignored.
    """
    found, start = None, None
    for tag in _ANSWER_TAG_RE.finditer(text):
        if not tag.group(1):
            start = tag.end() if start is None else start
        elif start is not None:
            found, start = (start, tag.start()), None
    return text[found[0] : found[1]].strip() if found else None


def extract_last_number(text: str) -> str | None:
    """The last number in `text` (integers, decimals, a/b fractions, 1,234 groupings), else None."""
    last = None
    for last in _NUMBER_RE.finditer(normalize_unicode(text)):
        pass
    if last is None:
        return None
    number = last.group().rstrip(",").replace(" ", "")
    return number


def normalize_unicode(text: str) -> str:
    """NFKC plus unicode math symbols as LaTeX (½ -> 1/2, − -> -, × -> \\times, ² -> ^2)."""
    text = unicodedata.normalize("NFKC", text.translate(_SUPERSCRIPTS))
    for symbol, latex in _UNICODE_OPS.items():
        text = text.replace(symbol, latex)
    return text


def normalize_answer(answer: str) -> str:
    """A canonical string for the exact-match fast path (never for deciding 'wrong' alone)."""
    text = normalize_unicode(answer).strip().rstrip(".").strip()
    text = text.strip("$").strip()
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = _NOISE_RE.sub("", text)
    text = text.rstrip(".")
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    return text


def as_integer(answer: str) -> int | None:
    """The integer a normalized answer spells ("42", "-7", "+3", "1,000"), else None."""
    return int(answer) if _INT_RE.fullmatch(answer) else None


def as_decimal(answer: str) -> Fraction | None:
    """The exact value of a plain decimal ("0.5", "12"), else None."""
    return Fraction(answer) if _DECIMAL_RE.fullmatch(answer) else None


def gold_answer(answer: str) -> str:
    """The final answer inside a dataset's reference text.

    GSM8K style ("...#### 72") -> after the last '####'; MATH / NuminaMath style (a solution
    containing \\boxed{...}) -> the last boxed content; otherwise the text itself.
    """
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    if "\\boxed" in answer or "\\fbox" in answer:
        boxed = extract_boxed(answer)
        if boxed is not None:
            return boxed
    return answer.strip()
