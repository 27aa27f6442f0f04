"""Benchmark: answer extractors and claim parsers on adversarial model outputs (linearity).

    python tools/bench_extract.py                  # time at 64 KiB and 1 MiB, ratio per case
    python tools/bench_extract.py --check          # run every case once at 1 MiB, print progress

Each case is an extractor applied to a hostile string of one kind (many opening tags and no
closing one, hyphen-joined "names", floods of braces, backslashes, spaces, ...). A linear
extractor's time grows ~16x from 64 KiB to 1 MiB; a quadratic one ~256x (the old
`<answer>(.*?)</answer>` regex took seconds at 64 KiB and never returned at 1 MiB).
tests/rewards/test_adversarial.py runs `--check` under a generous wall-clock bound.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxrl4llm.config import cli
from jaxrl4llm.rewards import countdown, extract, knights_knaves, math_verifier  # noqa: E402

KINDS = {
    "answer_tags": "<answer>",
    "answer_tags_x": "<ANSWER>x",
    "close_tags": "</answer>",
    "boxes": "\\boxed{",
    "box_spaces": "\\boxed ",
    "backslashes": "\\",
    "digits_commas": "1,",
    "slashes": "1 / ",
    "dots": "1.",
    "hyphen_names": "A-",
    "quote_names": "A'",
    "claims": "Zoey is a knight ",
    "verbs": "Zoey is ",
    "articles": "Zoey is a ",
    "hedges": "knight or a ",
    "fracs": "\\frac{",
    "fracs_closed": "\\frac{1}{",
    "equals": "=",
    "thousands": "1,000",
}
PREFIXED = {"braces": ("\\boxed", "{"), "spaces": ("1", " ")}  # one head, then a flood

_COUNTDOWN = {"prompt": "q", "answer": "", "metadata": {"numbers": [1, 2], "target": 3}}
_KK = {
    "prompt": "q",
    "answer": "",
    "metadata": {"names": ["Zoey", "Ann-Marie"], "solution": [True, False]},
}

FUNCTIONS: dict[str, Callable[[str], object]] = {
    "extract_answer_tag": extract.extract_answer_tag,
    "extract_boxed": extract.extract_boxed,
    "extract_last_number": extract.extract_last_number,
    "normalize_answer": extract.normalize_answer,
    "math_lenient": lambda t: math_verifier.extract_math_answer(t, "lenient"),
    "parse_claims": knights_knaves.parse_claims,
    "parse_claims_named": lambda t: knights_knaves.parse_claims(t, ["Zoey", "Ann-Marie"]),
    "clean_expression": countdown.clean_expression,
    "countdown_boxed": lambda t: countdown.CountdownVerifier().verify_one(
        "\\boxed{" + t + "}", _COUNTDOWN
    ),
    "countdown_tag": lambda t: countdown.CountdownVerifier().verify_one(
        "<answer>" + t + "</answer>", _COUNTDOWN
    ),
    "kk_boxed": lambda t: knights_knaves.KnightsKnavesVerifier().verify_one(
        "\\boxed{" + t + "}", _KK
    ),
    "kk_tag": lambda t: knights_knaves.KnightsKnavesVerifier().verify_one("<answer>" + t, _KK),
}


def texts(size: int) -> dict[str, str]:
    """Every adversarial kind, `size` characters long."""

    def flood(unit: str, n: int) -> str:
        return (unit * (n // len(unit) + 1))[:n]

    out = {kind: flood(unit, size) for kind, unit in KINDS.items()}
    out.update(
        {kind: head + flood(unit, size - len(head)) for kind, (head, unit) in PREFIXED.items()}
    )
    return out


def _time(fn: Callable[[str], object], text: str) -> float:
    start = time.perf_counter()
    fn(text)
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=1 << 20, help="largest input size")
    parser.add_argument(
        "--check",
        action="store_true",
        help="run every case once at --bytes, printing each before it starts",
    )
    args = parser.parse_args(argv)
    large = texts(args.bytes)
    if args.check:
        for fname, fn in FUNCTIONS.items():
            for kind, text in large.items():
                print(f"start {fname} {kind}", flush=True)
                fn(text)
        print("done", flush=True)
        return 0
    small = texts(args.bytes // 16)
    print(
        f"{'function':<22} {'worst kind':<16} {'t(1/16) s':>10} {'t(full) s':>10} "
        f"{'ratio':>7}   (linear ~16, quadratic ~256)"
    )
    for fname, fn in FUNCTIONS.items():
        rows = [(kind, _time(fn, small[kind]), _time(fn, large[kind])) for kind in large]
        kind, t_small, t_large = max(rows, key=lambda r: r[2])
        print(
            f"{fname:<22} {kind:<16} {t_small:>10.4f} {t_large:>10.4f} "
            f"{t_large / max(t_small, 1e-6):>7.1f}"
        )
    return 0


if __name__ == "__main__":
    cli.run(main, absl_flags=False)
