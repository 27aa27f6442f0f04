"""tools/bench_train.py's command line: --dtypes takes space- or comma-separated values, and
each child process gets every other option spelled out (nothing is lost or duplicated)."""
from __future__ import annotations

import os
import sys

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "tools")
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
    args = parser.parse_args(["--dtypes", "float32", "--prompts=3", "--no_remat",
                              "--new_tokens", "16", "--kl_coef=0.04", "--no_trl"])
    flags = bench_train.child_flags(args)
    assert not any(f.startswith(("--dtypes", "--child", "--trl", "--no_trl", "--hf_dir"))
                   for f in flags)   # unset --hf_dir (None) is not passed as "None"
    child = parser.parse_args(flags + ["--child=float32"])
    assert (child.prompts, child.new_tokens, child.remat, child.share_prompts) == (3, 16, False,
                                                                                  True)
    assert child.kl_coef == 0.04 and child.hf_dir is None
