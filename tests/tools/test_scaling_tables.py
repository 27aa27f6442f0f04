"""tools/scaling_tables.py: without planning, which flagfiles name a topology, the generated
blocks of docs/scaling.md, the figures read from plan.py's output into the tables, and the
summary rows read from the flagfiles; and (slow, opt-in: 27 plans, about 25 minutes) every
generated figure of docs/scaling.md regenerated and compared."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TOOLS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"
)
sys.path.insert(0, TOOLS)
import scaling_tables  # noqa: E402

from jaxrl4llm.config.errors import FlagError  # noqa: E402
from tools import scaling_doc  # noqa: E402


def test_flagfiles_name_their_topology_in_the_plan_command():
    topologies = scaling_tables.named_topologies()
    assert topologies["reinforce_pp_knights_knaves"] == ("8xh100",)
    assert topologies["tricks_or_traps_qwen3_8b_dapo"] == ("8xh200",)  # one GPU node
    assert topologies["minimalist_qwen25_math_7b_grpo"] == ("v5p-64",)
    assert "quickstart" not in topologies
    # A header with two plan commands is planned on both, one setting each.
    two = {"gspo_qwen3_30b_a3b": ("v5p-64", "8xh200")}
    gspo = scaling_tables.flagfile_settings(two)["gspo_qwen3_30b_a3b"]
    assert [s.heading for s in gspo] == [
        "`gspo_qwen3_30b_a3b.flags` on v5p-64",
        "`gspo_qwen3_30b_a3b.flags` on 8xh200",
    ]


def test_blocks_are_replaced_between_their_markers_and_split_into_sections():
    begin, end = scaling_doc.markers("plans")
    doc = f"intro\n{begin}\nold\n{end}\noutro\n"
    body = "### `a.flags` on v5p-64\n\ntable a\n\n### `a.flags` on v5p-64 with `x`\n\ntable b\n"
    new = scaling_doc.replace_block(doc, "plans", body)
    assert new == f"intro\n{begin}\n{body}{end}\noutro\n"
    assert scaling_doc.sections(scaling_doc.block(new, "plans")) == {
        "### `a.flags` on v5p-64": "### `a.flags` on v5p-64\n\ntable a\n",
        "### `a.flags` on v5p-64 with `x`": "### `a.flags` on v5p-64 with `x`\n\ntable b\n",
    }
    with pytest.raises(FlagError, match="lacks the markers"):
        scaling_doc.replace_block("no markers", "plans", body)


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


def _output(topology: str, **totals_gb: float) -> str:
    """plan.py --markdown's output for a step whose programs total `totals_gb` per device."""
    import contextlib
    import io

    from jaxrl4llm.planner import programs, report
    from jaxrl4llm.planner.topology import GB
    from jaxrl4llm.planner.topology import topology as topology_of

    rows = [
        programs.Row(p, 1, 0.0, 0.0, 0.0, 0.0, gb * GB, gb * GB, {}, 0.0, 1.5, 0.0, 2.5)
        for p, gb in totals_gb.items()
    ]
    rows[-1].collectives = {"all-gather": 800 * GB, "reduce-scatter": 400 * GB, "link": 1.0}
    plan = programs.Plan(
        "t", "m", topology_of(topology), rows, 1.0, programs.Rollout(8, 8, 4, 0.0, 0.0), 1
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report.print_plan(plan, markdown=True)
    return out.getvalue()


def test_figures_are_read_from_the_plans_output():
    f = scaling_doc.figures(_output("8xh100", create=10.0, rollout=77.1, update=50.0))
    assert f.totals == {"create": 10.0, "rollout": 77.1, "update": 50.0}
    assert f.fits == {"create": True, "rollout": False, "update": True}
    assert (f.budget, f.rollout_s, f.update_collectives) == (72.0, 2.5, 1200.0)
    assert f.step_s == 7.5  # 3 programs of 1 call x max(1.5, 0, 2.5) s


def test_tables_quote_the_plans_bold_where_a_program_does_not_fit(monkeypatch):
    """The limits row: the DAPO flagfile as shipped and with the change (the plans' figures
    here are made up); a variants row: the change against the knobs' flagfile and its
    topology."""
    settings = {
        "reinforce_pp_knights_knaves": [
            scaling_tables.Setting(("--flagfile=kk", "--topology=8xh100"), "kk", "ppo")
        ],
        "tricks_or_traps_qwen3_8b_dapo": [
            scaling_tables.Setting(("--flagfile=dapo", "--topology=8xh200"), "dapo", "dapo")
        ],
    }
    done = {s.argv: (0, _output("8xh200", rollout=89.6)) for ss in settings.values() for s in ss}
    for s in scaling_tables.limit_settings(settings):
        done.setdefault(s.argv, (1, _output("8xh200", rollout=133.1)))
    knob = scaling_tables._against(scaling_tables.KNOBS_FLAGFILE, ("--topology=v5e-8",), "v5p-64")
    done[knob.argv] = (1, _output("v5e-8", create=1.0, rollout=20.0, logprobs=2.0, update=3.0))
    monkeypatch.setattr(scaling_tables, "_DONE", done)
    limits = scaling_tables.limits_table(settings).splitlines()
    assert limits[2:] == [
        "| `tricks_or_traps_qwen3_8b_dapo.flags` (dapo) on 8xh200 | rollout | 89.6 | "
        "`--rollout_micro_batch=1024` | **133.1** | 126.9 |"
    ]
    variants = scaling_tables.variants_table([("--topology=v5e-8",)], "v5p-64").splitlines()
    assert variants[2] == "| (none) | v5e-8 | 1.0 | **20.0** | 2.0 | 3.0 | 1200.0 | 2.5 | 10.0 |"


def test_only_names_blocks_or_flagfiles():
    topologies = {"a": ("v5p-64",), "b": ("8xh100",)}
    assert scaling_tables._wanted(None, topologies) == (list(scaling_tables.BLOCKS), ["a", "b"])
    assert scaling_tables._wanted(["b", "lora"], topologies) == (
        ["summary", "plans", "lora"],
        ["b"],
    )
    assert scaling_tables._wanted(["knobs"], topologies) == (["summary", "knobs"], [])
    with pytest.raises(FlagError, match="--only: c name no block"):
        scaling_tables._wanted(["c"], topologies)


@pytest.mark.slow
def test_every_generated_figure_of_the_document_is_current():
    """tools/scaling_tables.py --check plans every block of docs/scaling.md again and fails
    on any difference, or when a flagfile (or a study's run of it, or a LoRA plan) does not
    fit its topology."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # plan.py fakes its own
    done = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "scaling_tables.py"), "--check"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, (done.stdout[-5000:], done.stderr[-3000:])
