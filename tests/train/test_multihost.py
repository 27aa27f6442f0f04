"""Two local processes (jax.distributed, 2 CPU devices each) train like one 4-device process."""
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrl4llm import rl
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.metrics import read_metrics

from tests.train.float_checks import LINEAR_OPT

WORKER = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
from jaxrl4llm import parallel
from jaxrl4llm.train import loop
from jaxrl4llm.train.config import TrainConfig
port, pid, config_json = sys.argv[1], int(sys.argv[2]), sys.argv[3]
parallel.maybe_initialize_distributed(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
assert jax.device_count() == 4 and jax.local_device_count() == 2
summary = loop.run(TrainConfig.from_json(open(config_json).read()))
print("FINAL_STEP", summary["step"], flush=True)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(model_dir, data, workdir):
    # Greedy decoding and plain Reinforce: the samples and the loss do not depend on how
    # the rows are split over hosts, so one process and two must agree. LINEAR_OPT: with
    # Adam's default eps a near-zero gradient's rounding, which differs between the layouts,
    # would move a weight by +-lr and step 2 would start from another policy.
    return TrainConfig().replace(
        model=model_dir, data=data, instruction="", prompts_per_step=8, group_size=4,
        max_prompt_tokens=16, max_new_tokens=1, temperature=0.0,
        algorithm=rl.get_preset("reinforce"), optimizer=LINEAR_OPT,
        num_steps=2, mesh="data:2,fsdp:2,tensor:1", eval_prompts=0, checkpoint_every=1,
        workdir=str(workdir), answer_mode="lenient", tensorboard=False)


def test_two_processes_match_one(toy_model_dir, copy_task_file, tmp_path):
    config = _config(toy_model_dir, copy_task_file, tmp_path / "two")
    config_json = tmp_path / "config.json"
    config_json.write_text(config.to_json())
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    # Output goes to files, not pipes: a worker blocked on a full pipe that nobody reads (the
    # other worker's is read first) would stall the collectives of both.
    logs = [(tmp_path / f"worker{pid}.out", tmp_path / f"worker{pid}.err") for pid in (0, 1)]
    procs = []
    for pid, (out_path, err_path) in zip((0, 1), logs):
        with open(out_path, "w") as out, open(err_path, "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, str(script), str(port), str(pid), str(config_json)],
                env=env, stdout=out, stderr=err, text=True))
    for p in procs:
        p.wait(timeout=600)
    for p, (out_path, err_path) in zip(procs, logs):
        assert p.returncode == 0, err_path.read_text()[-4000:]
        assert "FINAL_STEP 2" in out_path.read_text()

    one = loop.run(_config(toy_model_dir, copy_task_file, tmp_path / "one"),
                   devices=jax.devices()[:4])
    assert one["step"] == 2
    a, b = read_metrics(str(tmp_path / "one")), read_metrics(str(tmp_path / "two"))
    assert [r["step"] for r in b] == [1, 2]  # host 0 alone writes the metrics
    for ra, rb in zip(a, b):
        assert rb["reward/accuracy"] == pytest.approx(ra["reward/accuracy"])
        np.testing.assert_allclose(rb["policy/loss"], ra["policy/loss"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(rb["optim/grad_norm"], ra["optim/grad_norm"], rtol=1e-4)
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints"))[:2] == ["1", "2"]
