"""hf: sources from a hub cache written by the test (HF_HUB_OFFLINE=1: no network), and
without network: HF_ENDPOINT at a closed loopback port, so the tests behave the same on a
machine that can reach the Hub."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from jaxrl4llm.data.hub import HubSpec
from jaxrl4llm.data.records import DataError
from jaxrl4llm.data.sources import make_source

from tests.data.hub_fixtures import readme, write_repo

ROWS_V1 = [{"question": "1+1?", "answer": "2"}]
ROWS_V2 = [{"question": "2+2?", "answer": "4"}, {"question": "3+3?", "answer": "6"}]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return str(cache)


def test_spec_grammar():
    assert HubSpec.parse("openai/gsm8k:main@test") == HubSpec("openai/gsm8k", "main", "test")
    assert HubSpec.parse("HuggingFaceH4/MATH-500") == HubSpec("HuggingFaceH4/MATH-500")
    assert HubSpec.parse("a/b@validation").split == "validation"
    assert str(HubSpec("o/n", "c", "s")) == "hf:o/n:c@s"
    with pytest.raises(DataError, match="expected hf:OWNER/NAME"):
        HubSpec.parse("gsm8k")


def test_readme_configs_pick_the_files_of_a_config_and_split(hub):
    write_repo(
        hub,
        "o/qa",
        {
            "README.md": readme(
                [
                    {"name": "main", "files": {"train": "main/train-*", "test": "main/test-*"}},
                    {"name": "other", "files": {"test": "other/test-*"}},
                ]
            ),
            "main/train-00000-of-00001.parquet": ROWS_V2,
            "main/test-00000-of-00002.parquet": ROWS_V1,
            "main/test-00001-of-00002.parquet": ROWS_V2,
            "other/test-00000-of-00001.parquet": [{"question": "x", "answer": "y"}],
        },
    )
    test = make_source("hf:o/qa:main", split="test")
    assert [r.prompt for r in test] == ["1+1?", "2+2?", "3+3?"]  # both shards, in order
    assert len(make_source("hf:o/qa:main", split="train")) == 2
    assert [r.answer for r in make_source("hf:o/qa:other@test")] == ["y"]  # @SPLIT wins
    origin = test[0].metadata["origin"]
    assert origin.startswith("hf:o/qa@") and origin.endswith(
        "main/test-00000-of-00002.parquet:row 1"
    )
    with pytest.raises(DataError, match="configs main, other; name one, e.g. hf:o/qa:main"):
        make_source("hf:o/qa", split="test")
    with pytest.raises(DataError, match="no config 'nope'"):
        make_source("hf:o/qa:nope", split="test")
    with pytest.raises(DataError, match="config 'other' has no split 'train'; it has test"):
        make_source("hf:o/qa:other", split="train")


def test_without_readme_the_split_is_in_the_file_name(hub):
    write_repo(hub, "o/files", {"train.jsonl": ROWS_V2, "data/test-0.jsonl": ROWS_V1})
    assert [r.answer for r in make_source("hf:o/files", split="test")] == ["2"]
    assert [r.answer for r in make_source("hf:o/files", split="train")] == ["4", "6"]
    write_repo(hub, "o/plain", {"all.parquet": ROWS_V2})  # no split name: the train split
    assert len(make_source("hf:o/plain", split="train")) == 2
    with pytest.raises(DataError, match="no data file for split 'test'"):
        make_source("hf:o/plain", split="test")


def test_revision_pinning_by_tag_and_commit(hub):
    old = write_repo(hub, "o/rev", {"test.jsonl": ROWS_V1}, revision="v1")
    write_repo(hub, "o/rev", {"test.jsonl": ROWS_V2, "extra.txt": "x"}, revision="main")
    assert len(make_source("hf:o/rev", split="test")) == 2  # main
    assert len(make_source("hf:o/rev", split="test", revision="v1")) == 1
    pinned = make_source("hf:o/rev", split="test", revision=old)  # a commit hash
    assert [r.prompt for r in pinned] == ["1+1?"] and old in pinned.name
    assert old in pinned[0].metadata["origin"]


def test_offline_missing_file_names_the_repository_and_the_file(hub):
    # The README names test.jsonl, but the cache has only the README (never downloaded).
    write_repo(
        hub,
        "o/partial",
        {"README.md": readme([{"name": "default", "files": {"test": "test.jsonl"}}])},
    )
    with pytest.raises(DataError) as err:
        make_source("hf:o/partial", split="test")
    message = str(err.value)
    assert "hf:o/partial" in message and "'test.jsonl'" in message
    assert "HF_HUB_OFFLINE" in message
    assert f"hf download o/partial --repo-type dataset --cache-dir {hub}" in message
    # A repository that was never cached: named, with the revision.
    with pytest.raises(DataError, match="hf:o/absent: revision 'main' is not in the hub cache"):
        make_source("hf:o/absent", split="test")
    with pytest.raises(DataError, match="revision 'v9' is not in the hub cache"):
        make_source("hf:o/partial", split="test", revision="v9")


def test_field_names_and_json_array_files(hub):
    write_repo(
        hub,
        "o/json",
        {
            "data/test.json": "["
            + ",".join('{"q": "Q%d", "sol": "%d", "task": "arithmetic"}' % (i, i) for i in range(3))
            + "]"
        },
    )
    source = make_source("hf:o/json", split="test", prompt_field="q", answer_field="sol")
    assert [(r.prompt, r.answer, r.task) for r in source] == [
        ("Q0", "0", "arithmetic"),
        ("Q1", "1", "arithmetic"),
        ("Q2", "2", "arithmetic"),
    ]


def test_readme_data_files_as_a_mapping_and_a_plain_list(hub):
    write_repo(
        hub,
        "o/map",
        {
            "README.md": "---\nconfigs:\n- config_name: default\n  data_files:\n"
            "    test: held/out.jsonl\n---\n",
            "held/out.jsonl": ROWS_V2,
        },
    )
    assert len(make_source("hf:o/map", split="test")) == 2
    write_repo(
        hub,
        "o/list",
        {
            "README.md": "---\nconfigs:\n- config_name: default\n  data_files:"
            "\n  - a.jsonl\n  - b.jsonl\n---\n",
            "a.jsonl": ROWS_V1,
            "b.jsonl": ROWS_V2,
        },
    )
    assert len(make_source("hf:o/list", split="train")) == 3  # paths without a split: train


CLOSED_ENDPOINT = "http://127.0.0.1:9"  # the discard port: nothing listens there


@pytest.fixture
def no_network(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_ENDPOINT)
    from huggingface_hub import constants  # read HF_HUB_OFFLINE when first imported

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for proxy in (
        "http_proxy",
        "https_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "all_proxy",
        "ALL_PROXY",
    ):
        monkeypatch.delenv(proxy, raising=False)
    return str(cache)


def test_without_network_an_uncached_repo_fails_fast_with_the_download_command(no_network):
    start = time.perf_counter()
    with pytest.raises(DataError) as err:
        make_source("hf:o/remote:main", split="train")
    assert time.perf_counter() - start < 5
    message = str(err.value)
    assert "\n" not in message
    assert "hf:o/remote" in message and CLOSED_ENDPOINT in message and no_network in message
    assert f"`hf download o/remote --repo-type dataset --cache-dir {no_network}`" in message


def test_without_network_a_cached_repo_names_hf_hub_offline(no_network, monkeypatch):
    write_repo(no_network, "o/cached", {"train.jsonl": ROWS_V1})
    with pytest.raises(DataError) as err:
        make_source("hf:o/cached", split="train")
    message = str(err.value)
    assert "HF_HUB_OFFLINE=1" in message and no_network in message
    assert "hf download" not in message
    # ... and with it set, the cache serves the rows.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert [r.answer for r in make_source("hf:o/cached", split="train")] == ["2"]


def test_train_with_an_hf_source_and_no_network_exits_2_in_one_line(no_network, tmp_path):
    """The whole command: one line naming the fix, exit 2, none of huggingface_hub's retry
    lines (each retry prints one; five take ~25 s)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    model = tmp_path / "model"  # passes the flag check; the data fails before it loads
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--data=hf:o/remote",
            f"--model={model}",
            f"--workdir={tmp_path / 'run'}",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and "hf download o/remote" in lines[0], result.stderr[-3000:]
    assert "Retry" not in result.stderr and "Traceback" not in result.stderr
