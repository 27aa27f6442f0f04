"""tools/scaling_tables.py without planning: which flagfiles name a topology, the generated
blocks of docs/scaling.md, and the summary rows read from the flagfiles."""

from __future__ import annotations

import os
import sys

import pytest

TOOLS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"
)
sys.path.insert(0, TOOLS)
import scaling_tables  # noqa: E402

from jaxrl4llm.config.errors import FlagError  # noqa: E402


def test_flagfiles_name_their_topology_in_the_plan_command():
    topologies = scaling_tables.named_topologies()
    assert topologies["reinforce_pp_knights_knaves"] == "8xh100"
    assert topologies["tricks_or_traps_qwen3_8b_dapo"] == "8xh200"  # one GPU node
    assert topologies["minimalist_qwen25_math_7b_grpo"] == "v5p-64"
    assert "quickstart" not in topologies


def test_blocks_are_replaced_between_their_markers_and_split_into_sections():
    begin, end = scaling_tables.markers("plans")
    doc = f"intro\n{begin}\nold\n{end}\noutro\n"
    body = "### `a.flags` on v5p-64\n\ntable a\n\n### `b.flags` on 8xh100\n\ntable b\n"
    new = scaling_tables.replace_block(doc, "plans", body)
    assert new == f"intro\n{begin}\n{body}{end}\noutro\n"
    assert scaling_tables.sections(scaling_tables.block(new, "plans")) == {
        "a": "### `a.flags` on v5p-64\n\ntable a\n",
        "b": "### `b.flags` on 8xh100\n\ntable b\n",
    }
    with pytest.raises(FlagError, match="lacks the markers"):
        scaling_tables.replace_block("no markers", "plans", body)


def test_summary_rows_come_from_the_flagfiles():
    rows = scaling_tables.summary_table(scaling_tables.named_topologies()).splitlines()
    kk = next(r for r in rows if "reinforce_pp_knights_knaves.flags" in r)
    # The flagfile: 32 prompts x 8, mini-batch = the batch (256 rows), 1024 + 4096 tokens,
    # lr 5e-7, float32 master weights with bfloat16 compute, planned for 8 H100s.
    assert kk == (
        "| `reinforce_pp_knights_knaves.flags` | Qwen2.5-7B-Instruct-1M | reinforce_pp | "
        "32 x 8 | 256 | 1024 + 4096 | 5e-07 | float32 / bfloat16 | 8xh100 |"
    )
    assert not any("quickstart" in r for r in rows)
