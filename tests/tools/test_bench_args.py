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


def _child_result(step: float, **values) -> dict:
    """What a child process reports (zeros but the step, `values` and what the tables read)."""
    zero = (
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
        **{k: 0.0 for k in zero},
        **values,
    }


def test_rounds_alternate_the_sides_and_keep_each_sides_fastest(monkeypatch, capsys):
    calls = []
    steps = {"float32": [5.0, 3.0], "trl/float32": [9.0, 11.0]}

    def fake_child(args, child):
        calls.append(child)
        if child == "export":
            return {"hf_dir": args.hf_dir}
        return _child_result(steps[child].pop(0))

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


def test_lora_rank_adds_a_lora_side_and_its_ratios_to_full(monkeypatch, capsys):
    """--lora_rank=16: each round runs our full step, then the LoRA one (its own process);
    the comparison table gives both sides' step, update and peak RSS and LoRA / full."""
    calls = []
    # (step, update, peak RSS) of each side's two rounds: the fastest step is kept.
    figures = {
        "float32": [(4.0, 2.0, 1.0), (5.0, 9.0, 9.0)],
        "lora/float32": [(6.0, 1.0, 2.0), (3.0, 0.5, 0.8)],
    }

    def fake_child(args, child):
        calls.append(child)
        step, update, rss = figures[child].pop(0)
        dtype = "lora16/float32" if child.startswith(bench_train.LORA) else "float32"
        return _child_result(step, dtype=dtype, update_s=update, peak_rss_gib=rss)

    monkeypatch.setattr(bench_train, "run_child", fake_child)
    assert bench_train.main(["--dtypes=float32", "--no_trl", "--rounds=2", "--lora_rank=16"]) == 0
    assert calls == ["float32", "lora/float32"] * 2
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("|")] for line in out.splitlines() if "|" in line]
    assert ["lora16/float32", "0.00", "0.50", "0.00", "0.50", "3.00"] == rows[2][:6]  # its stages
    cells = next(r for r in rows if r[:2] == ["float32", "lora16"])
    assert cells == [
        "float32",
        "lora16",
        "4.00",
        "3.00",
        "0.75",
        "2.00",
        "0.50",
        "0.25",
        "1.00",
        "0.80",
        "0.80",
    ]


def test_the_lora_child_gets_the_rank_and_targets():
    from jaxrl4llm.config.errors import FlagError
    from jaxrl4llm.models.lora import LoraConfig
    from jaxrl4llm.train.config import TrainConfig
    from tools import bench_train_ours  # our side's module (repo root on sys.path)

    parser = bench_train.build_parser()
    args = parser.parse_args(["--lora_rank=16", "--lora_targets=q,v", "--no_trl"])
    flags = bench_train.child_flags(args)
    full = parser.parse_args(flags + ["--child=float32"])
    lora = parser.parse_args(flags + ["--child=float32", "--lora_child"])
    assert not bench_train_ours.lora_config(full, TrainConfig()).lora.enabled
    assert bench_train_ours.lora_config(lora, TrainConfig()).lora == LoraConfig(
        rank=16, targets=("q", "v")
    )
    assert parser.parse_args([]).lora_targets == ["q", "k", "v", "o", "gate", "up", "down"]
    with pytest.raises(FlagError, match="qkv"):
        parser.parse_args(["--lora_targets=qkv"])


def test_cpu_isa_caps_every_library_and_replaces_an_earlier_xla_cap():
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=SSE4_2"}
    env = bench_train.isa_env("AVX2", environ)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=AVX2"
    assert bench_train.isa_env(None, environ) == environ
    args = bench_train.build_parser().parse_args(["--cpu_isa=AVX2"])
    assert "--cpu_isa=AVX2" in bench_train.child_flags(args)


def test_cpu_description_names_the_model_and_its_vector_extensions():
    cpuinfo = (
        "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu sse avx avx2 avx512f avx512bw\n"
        "processor\t: 1\nmodel name\t: Some Xeon\nflags\t\t: fpu sse avx avx2 avx512f avx512bw\n"
    )
    assert bench_train.cpu_description(cpuinfo) == "Some Xeon (avx2, avx512f)"
    assert bench_train.cpu_description("model name : Old\nflags : sse avx\n") == "Old (no avx2)"
