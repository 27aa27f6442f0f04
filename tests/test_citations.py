"""Paper citations are self-contained: docs, paper flagfiles and study specs name the paper by its
arXiv id and its section, equation, table or figure, never a text outside the repository (the
papers' local copies, `NNN_<hash>.txt`, and their line numbers are not part of it)."""

import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_SUFFIXES = (".md", ".json", ".toml", ".flags", ".txt", ".yaml", ".yml", ".csv")


def _files():
    paths = [os.path.join(REPO, "README.md")]
    for folder in ("docs", "experiments/configs", "experiments/studies"):
        paths += glob.glob(os.path.join(REPO, folder, "**", "*"), recursive=True)
    return sorted(p for p in paths if os.path.isfile(p) and p.endswith(TEXT_SUFFIXES))


FILES = _files()

# A path outside the repository, a paper copy's file name, or the shorthand that cited one
# ("001:203", "002 line 212", "000 lines 94-98").
OUTSIDE = re.compile(
    r"shared/papers|\.\./shared/|\b\d{3}_[\w.-]*\.txt\b|(?<![\w.])00\d(:\d+| lines? \d+)"
)
ARXIV_ID = re.compile(r"\d{4}\.\d{4,5}")  # NNNN.NNNNN (NNNN.NNNN before 2015)


def test_the_files_are_found():
    names = {os.path.relpath(p, REPO) for p in FILES}
    assert "README.md" in names and "docs/algorithms.md" in names
    assert any(n.startswith("experiments/configs/") for n in names)
    assert any(n.startswith("experiments/studies/") for n in names)


@pytest.mark.parametrize("path", FILES, ids=lambda p: os.path.relpath(p, REPO))
def test_citations_are_self_contained(path):
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    where = os.path.relpath(path, REPO)
    for n, line in enumerate(lines, 1):
        assert not OUTSIDE.search(line), f"{where}:{n} cites a text outside the repository: {line}"
        if "arxiv" in line.lower():
            assert ARXIV_ID.search(line), f"{where}:{n} mentions arXiv without an id: {line}"
