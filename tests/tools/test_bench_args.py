"""tools/bench_train.py's command line: --dtypes takes space- or comma-separated values, and
each child process gets every other option spelled out (nothing is lost or duplicated)."""

from __future__ import annotations

import os
import sys

import pytest

TOOLS = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"
)
sys.path.insert(0, TOOLS)
import bench_train  # noqa: E402


def test_dtypes_space_or_comma_separated():
    parser = bench_train.build_parser()
    spaced = parser.parse_args(["--dtypes", "float32", "bfloat16", "--prompts=2"])
    commas = parser.parse_args(["--dtypes=float32,bfloat16"])
    assert bench_train.dtype_list(spaced.dtypes) == ["float32", "bfloat16"]
    assert bench_train.dtype_list(commas.dtypes) == ["float32", "bfloat16"]
    assert spaced.prompts == 2


def test_child_flags_round_trip():
    parser = bench_train.build_parser()
    args = parser.parse_args(
        [
            "--dtypes",
            "float32",
            "--prompts=3",
            "--no_remat",
            "--new_tokens",
            "16",
            "--kl_coef=0.04",
            "--no_trl",
        ]
    )
    flags = bench_train.child_flags(args)
    assert not any(
        f.startswith(("--dtypes", "--child", "--trl", "--no_trl", "--hf_dir")) for f in flags
    )  # unset --hf_dir (None) is not passed as "None"
    child = parser.parse_args(flags + ["--child=float32"])
    assert (child.prompts, child.new_tokens, child.remat, child.share_prompts) == (
        3,
        16,
        False,
        True,
    )
    assert child.kl_coef == 0.04 and child.hf_dir is None


def test_rounds_alternate_the_sides_and_keep_each_sides_fastest(monkeypatch, capsys):
    calls = []
    steps = {"float32": [5.0, 3.0], "trl/float32": [9.0, 11.0]}

    def fake_child(args, child):
        calls.append(child)
        if child == "export":
            return {"hf_dir": args.hf_dir}
        step = steps[child].pop(0)
        return {
            "dtype": "float32",
            "step_s": step,
            "reward_s": 0.5,
            "peak_rss_gib": step / 10,
            "floor_share": 1 / step,
            "device": "cpu",
            "xla_threads": 2,
            "trl": "1",
            "torch": "2",
            "torch_threads": 2,
            "omp_wait_policy": None,
            "mean_new_tokens": 8.0,
            **{
                k: 0.0
                for k in (
                    "rollout_s",
                    "reference_s",
                    "update_s",
                    "sample_tok_s",
                    "update_tok_s",
                    "compile_step_s",
                    "step_tflop",
                    "matmul_gflops",
                    "floor_s",
                    "verify_s",
                )
            },
        }

    monkeypatch.setattr(bench_train, "run_child", fake_child)
    from tools import bench_trl  # the module main() imports (repo root put on sys.path by it)

    monkeypatch.setattr(bench_trl, "trl_available", lambda: True)  # CI has no trl
    assert bench_train.main(["--dtypes=float32", "--rounds=2"]) == 0
    assert calls == ["export", "float32", "trl/float32", "float32", "trl/float32"]
    out = capsys.readouterr().out
    # ours kept 3.0 (round 2), TRL kept 9.0 (round 1): ratio 1/3, RSS of the kept runs.
    assert "ours float32: steps of the 2 rounds 5.00, 3.00 s" in out
    assert "TRL float32: steps of the 2 rounds 9.00, 11.00 s" in out
    row = [line for line in out.splitlines() if line.strip().startswith("float32 |")][-1]
    cells = [c.strip() for c in row.split("|")]
    assert cells[1:4] == ["3.00", "9.00", "0.33"] and cells[-2] == "0.33"


def test_fastest_of_no_or_failed_rounds_is_none():
    assert bench_train.fastest([]) is None
    assert bench_train.fastest([{"step_s": 1.0}, None]) is None


def test_zero_rounds_is_a_usage_error():
    from jaxrl4llm.config.errors import FlagError

    with pytest.raises(FlagError, match="--rounds=0"):  # exit 2, one line, via cli.run
        bench_train.main(["--rounds=0"])
