"""Hub dataset repositories in the hub cache's layout, written by the tests (no network).

    HF_HUB_CACHE/datasets--OWNER--NAME/refs/REVISION      -> a commit hash
    HF_HUB_CACHE/datasets--OWNER--NAME/snapshots/COMMIT/PATH

With HF_HUB_OFFLINE=1, huggingface_hub reads exactly this (as after a real download).
The rows below are written by hand in each benchmark's published schema (column names and
types as the repositories publish them), a few per set.
"""

from __future__ import annotations

import hashlib
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq


def readme(configs: list[dict]) -> str:
    """A README.md whose YAML header has a `configs:` block, as the Hub writes it."""
    lines = ["---", "configs:"]
    for config in configs:
        lines.append(f"- config_name: {config['name']}")
        if config.get("default"):
            lines.append("  default: true")
        lines.append("  data_files:")
        for split, path in config["files"].items():
            lines += [f"  - split: {split}", f"    path: {path}"]
    return "\n".join(lines + ["---", "", "# fixture"]) + "\n"


def write_repo(
    cache: str,
    repo: str,
    files: dict[str, object],
    revision: str = "main",
    commit: str | None = None,
) -> str:
    """Writes `files` (path -> rows for .parquet / .jsonl, or text) as one commit of `repo`
    in the cache and points `revision` at it; returns the commit hash."""
    commit = commit or hashlib.sha1(f"{repo}{sorted(files)}{revision}".encode()).hexdigest()
    root = os.path.join(cache, "datasets--" + repo.replace("/", "--"))
    for path, content in files.items():
        local = os.path.join(root, "snapshots", commit, path)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        if path.endswith(".parquet"):
            pq.write_table(pa.Table.from_pylist(content), local)
        elif path.endswith(".jsonl"):
            with open(local, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in content)
        else:
            with open(local, "w") as f:
                f.write(content)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", revision), "w") as f:
        f.write(commit)
    return commit


# ---- the registry's repositories, a few rows each, in their published schemas -----------

MATH500 = [
    {
        "problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.",
        "solution": (
            "... so the polar coordinates are $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$"
        ),
        "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
        "subject": "Precalculus",
        "level": 2,
        "unique_id": "test/precalculus/807.json",
    },
    {
        "problem": "What is the value of $513^2 - 487^2$?",
        "solution": "... $\\boxed{26000}$.",
        "answer": "26000",
        "subject": "Algebra",
        "level": 1,
        "unique_id": "test/algebra/2411.json",
    },
]
AIME24 = [
    {
        "id": 60,
        "problem": "Every morning Aya goes for a $9$-kilometer-long walk ...",
        "solution": "... $\\boxed{204}$",
        "answer": "204",
        "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/Problem_1",
        "year": "2024",
    },
    {
        "id": 61,
        "problem": "There exist real numbers $x$ and $y$, both greater than 1 ...",
        "solution": "... $\\boxed{025}$",
        "answer": "025",
        "url": "https://...",
        "year": "2024",
    },
]
AIME25 = [
    {
        "problem_idx": 1,
        "problem": "Find the sum of all integer bases $b>9$ for which $17_b$ is "
        "a divisor of $97_b$.",
        "answer": 70,
        "problem_type": ["Number Theory"],
    },
    {
        "problem_idx": 2,
        "problem": "On $\\triangle ABC$ points $A, D, E$, and $B$ lie ...",
        "answer": 588,
        "problem_type": ["Geometry"],
    },
]
AMC23 = [
    {
        "problem": "Cities $A$ and $B$ are $45$ miles apart. ... How many miles from City $A$ "
        "will they be when they meet?",
        "answer": 27.0,
    },
    {
        "problem": "Positive real numbers $x$ and $y$ satisfy $y^3=x^2$ and $(y-x)^2=4y^2$. What "
        "is $x+y$?",
        "answer": 36.0,
    },
]
MINERVA = [
    {
        "question": "Each of the two Magellan telescopes has a diameter of $6.5 \\mathrm{~m}$. ... "
        "what is the minimum angular resolution in arcseconds?",
        "answer": "0.49",
    },
    {"question": "Preamble: ... Find the rest-frame wavelength in \\AA.", "answer": "1216"},
]
OLYMPIAD = [
    {
        "id": 1606,
        "question": "Xenia and Sergey play the following game. ... What is the "
        "smallest number of moves that Sergey needs?",
        "solution": ["The answer is $n=2$. ..."],
        "final_answer": ["$2$"],
        "context": None,
        "image_1": None,
        "image_2": None,
        "image_3": None,
        "image_4": None,
        "image_5": None,
        "modality": "Text-only",
        "difficulty": "Competition",
        "is_multiple_answer": False,
        "unit": None,
        "answer_type": "Numerical",
        "error": None,
        "question_type": "Open-ended",
        "subfield": "Combinatorics",
        "subject": "Math",
        "language": "English",
    },
    {
        "id": 1610,
        "question": "Find all pairs $(m, n)$ of nonnegative integers for which "
        "$m^{2}+2 \\cdot 3^{n}=m\\left(2^{n+1}-1\\right)$.",
        "solution": ["..."],
        "final_answer": ["$(6,3),(9,3),(9,5),(54,5)$"],
        "context": None,
        "image_1": None,
        "image_2": None,
        "image_3": None,
        "image_4": None,
        "image_5": None,
        "modality": "Text-only",
        "difficulty": "Competition",
        "is_multiple_answer": True,
        "unit": None,
        "answer_type": "Tuple",
        "error": None,
        "question_type": "Open-ended",
        "subfield": "Number Theory",
        "subject": "Math",
        "language": "English",
    },
]
GSM8K_TRAIN = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
        "many clips in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
        "<<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
]
GSM8K_TEST = [
    {
        "question": "Janet's ducks lay 16 eggs per day. ... How much in dollars does she make "
        "every day at the farmers' market?",
        "answer": "... 16 - 3 - 4 = <<16-3-4=9>>9 ... "
        "9 * 2 = $<<9*2=18>>18 every day at the farmer's market.\n#### 18",
    },
    {
        "question": "A company pays ... How much does it pay in total?",
        "answer": "... = <<1000+250=1250>>1,250\n#### 1,250",
    },
]
NUMINA = [
    {
        "problem": "Find the value of $x$ if $2x + 3 = 11$.",
        "answer": "4",
        "solution": "Subtracting 3 ... $x = \\boxed{4}$.",
    },
    {
        "problem": "Prove that the sum of two odd numbers is even.",
        "answer": "",
        "solution": "Let the numbers be ... which is even.",
    },
    {
        "problem": "Compute $\\frac{1}{2} + \\frac{1}{3}$.",
        "answer": "\\boxed{\\frac{5}{6}}",
        "solution": "... $\\boxed{\\frac{5}{6}}$",
    },
    {"problem": "Show that ...", "answer": None, "solution": "..."},
]
DAPO = [
    {
        "prompt": "In triangle $ABC$, $\\sin \\angle A = \\frac{4}{5}$ ... find $k+m$.",
        "solution": "34",
        "data_source": "math_dapo",
        "source_prompt": [
            {"content": "Solve the following math problem step by step. ...", "role": "user"}
        ],
        "ability": "MATH",
        "reward_model": {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
    },
]

REPOS = {  # repository -> (README configs, files)
    "HuggingFaceH4/MATH-500": (
        [{"name": "default", "files": {"test": "test.jsonl"}}],
        {"test.jsonl": MATH500},
    ),
    "HuggingFaceH4/aime_2024": (
        [{"name": "default", "files": {"train": "data/train-*"}}],
        {"data/train-00000-of-00001.parquet": AIME24},
    ),
    "MathArena/aime_2025": (
        [{"name": "default", "files": {"train": "data/train-*"}}],
        {"data/train-00000-of-00001.parquet": AIME25},
    ),
    "knoveleng/AMC-23": (None, {"data/train-00000-of-00001.parquet": AMC23}),
    "math-ai/minervamath": (None, {"test.jsonl": MINERVA}),
    "Hothan/OlympiadBench": (
        [
            {"name": "OE_TO_maths_en_COMP", "files": {"train": "OE_TO_maths_en_COMP/train-*"}},
            {"name": "OE_TO_physics_en_COMP", "files": {"train": "OE_TO_physics_en_COMP/train-*"}},
        ],
        {
            "OE_TO_maths_en_COMP/train-00000-of-00001.parquet": OLYMPIAD,
            "OE_TO_physics_en_COMP/train-00000-of-00001.parquet": OLYMPIAD[:1],
        },
    ),
    "openai/gsm8k": (
        [
            {
                "name": "main",
                "default": False,
                "files": {"train": "main/train-*", "test": "main/test-*"},
            },
            {"name": "socratic", "files": {"train": "socratic/train-*", "test": "socratic/test-*"}},
        ],
        {
            "main/train-00000-of-00001.parquet": GSM8K_TRAIN,
            "main/test-00000-of-00001.parquet": GSM8K_TEST,
            "socratic/train-00000-of-00001.parquet": GSM8K_TRAIN,
            "socratic/test-00000-of-00001.parquet": GSM8K_TEST,
        },
    ),
    "ScaleML-RLHF/numina_math": (None, {"data/train-00000-of-00001.parquet": NUMINA}),
    "open-r1/DAPO-Math-17k-Processed": (
        [
            {"name": "all", "default": True, "files": {"train": "all/train-*"}},
            {"name": "en", "files": {"train": "en/train-*"}},
        ],
        {"all/train-00000-of-00001.parquet": DAPO, "en/train-00000-of-00001.parquet": DAPO},
    ),
}

# nlile/hendrycks-MATH-benchmark (MATH's 12k / 500 split): `level` is an int, `answer` the
# final answer. Levels 1 and 2 are left out of math_lvl3to5_8k; the rest are kept in order.
MATH12K = [
    {
        "problem": "What is $1+1$?",
        "solution": "$\\boxed{2}$",
        "answer": "2",
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "train/prealgebra/1.json",
    },
    {
        "problem": "Solve $x^2 = 49$ for the positive root $x$.",
        "solution": "$\\boxed{7}$",
        "answer": "7",
        "subject": "Algebra",
        "level": 3,
        "unique_id": "train/algebra/2.json",
    },
    {
        "problem": "Compute $3 \\cdot 4$.",
        "solution": "$\\boxed{12}$",
        "answer": "12",
        "subject": "Prealgebra",
        "level": 2,
        "unique_id": "train/prealgebra/3.json",
    },
    {
        "problem": "How many positive divisors does $36$ have?",
        "solution": "$\\boxed{9}$",
        "answer": "9",
        "subject": "Number Theory",
        "level": 5,
        "unique_id": "train/number_theory/4.json",
    },
    {
        "problem": "Find $\\frac{1}{2} + \\frac{1}{3}$.",
        "solution": "$\\boxed{\\frac{5}{6}}$",
        "answer": "\\frac{5}{6}",
        "subject": "Algebra",
        "level": 4,
        "unique_id": "train/algebra/5.json",
    },
]
REPOS["nlile/hendrycks-MATH-benchmark"] = (
    None,
    {"data/train-00000-of-00001.parquet": MATH12K, "data/test-00000-of-00001.parquet": MATH12K[:1]},
)


def write_registry_repos(cache: str) -> None:
    for repo, (configs, files) in REPOS.items():
        files = dict(files)
        if configs is not None:
            files["README.md"] = readme(configs)
        write_repo(cache, repo, files)
