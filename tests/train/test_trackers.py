"""--trackers: W&B and MLflow offline get metrics.jsonl's records under the same names, the
config as hyper-parameters, and a resumed run continues the same tracker run."""

import glob
import json
import os
import struct

import pytest

from jaxrl4llm.config.errors import DependencyError, FlagError
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.config.checks import validate
from jaxrl4llm.train.infra import metrics, trackers

HPARAMS = {"learning_rate": 1e-6, "algorithm": "grpo", "mesh": "data:1,fsdp:-1,tensor:1"}


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


def _two_sessions(workdir):
    """A run that logs steps 1-2, stops, and resumes to log step 3."""
    writer = metrics.MetricsWriter(str(workdir), trackers=("wandb", "mlflow"), hparams=HPARAMS)
    writer.write(1, {"reward/mean": 0.25, "eval/math500/avg@16": 0.5})
    writer.write(2, {"reward/mean": 0.5, "policy/kl_ref": float("nan")})
    writer.close()
    writer = metrics.MetricsWriter(str(workdir), trackers=("wandb", "mlflow"), hparams=HPARAMS)
    writer.write(3, {"reward/mean": 0.75})
    writer.close()


def _wandb_records(path):
    """The protobuf Records of a .wandb file (a 7-byte header, then LevelDB-log framing:
    32 KiB blocks of [crc32 u32, length u16, type u8] chunks; types 1 full, 2-4 first /
    middle / last)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_and_mlflow_offline_log_the_same_metrics_and_resume_the_same_run(tmp_path, offline):
    _two_sessions(tmp_path)
    ids = json.loads((tmp_path / trackers.IDS_FILE).read_text())
    assert set(ids) == {"wandb", "mlflow"}

    # W&B: two offline sessions of one run id; steps 1, 2 then 3, same names as the JSONL.
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(runs) == 2 and all(path.endswith(f"run-{ids['wandb']}.wandb") for path in runs)
    history, run_ids, config_keys = [], set(), set()
    for path in runs:
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                history.append(
                    {k: v for k, v in items.items() if not k.startswith("_")}
                    | {"step": items["_step"]}
                )
            elif kind == "run":
                run_ids.add(record.run.run_id)
                config_keys |= {i.key or "/".join(i.nested_key) for i in record.run.config.update}
    assert run_ids == {ids["wandb"]}
    assert set(HPARAMS) <= config_keys
    assert history == [
        {"reward/mean": 0.25, "eval/math500/avg@16": 0.5, "step": 1},
        {"reward/mean": 0.5, "step": 2},  # NaN left out, as in TensorBoard
        {"reward/mean": 0.75, "step": 3},
    ]

    # MLflow: one run in WORKDIR/mlflow.db, params = the config, same names ('@' -> '_').
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(ids["mlflow"])
    assert run.data.params == {k: str(v) for k, v in HPARAMS.items()}
    assert run.info.status == "FINISHED"
    reward = sorted(
        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")
    )
    assert reward == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [
        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/math500/avg_16")
    ] == [(1, 0.5)]
    experiment = client.get_experiment_by_name(trackers.PROJECT)
    assert len(client.search_runs([experiment.experiment_id])) == 1


def test_an_unknown_or_missing_tracker_is_a_flag_error(monkeypatch):
    with pytest.raises(FlagError, match=r"--trackers=tensorboard,comet: unknown tracker"):
        validate(TrainConfig().replace(trackers="tensorboard,comet"), 8)
    monkeypatch.setitem(trackers.PACKAGES, "wandb", ("no_such_module_xyz", "jaxrl4llm[wandb]"))
    with pytest.raises(DependencyError, match=r"pip install 'jaxrl4llm\[wandb\]'"):
        validate(TrainConfig().replace(trackers="wandb"), 8)
    assert TrainConfig().replace(
        trackers="tensorboard,mlflow", tensorboard=False
    ).run.tracker_names == ("mlflow",)


def test_tensorboard_is_a_deprecated_alias_of_trackers(caplog):
    base = TrainConfig().replace(trackers="wandb,mlflow")
    assert base.run.tracker_names == ("wandb", "mlflow")  # unset: --trackers alone
    assert base.replace(tensorboard=True).run.tracker_names == ("tensorboard", "wandb", "mlflow")
    assert TrainConfig().replace(tensorboard=False).run.tracker_names == ()
    with caplog.at_level("WARNING"):
        validate(TrainConfig().replace(tensorboard=False), 8)
    assert "--notensorboard is deprecated" in caplog.text and "--trackers=." in caplog.text


def test_only_named_trackers_are_imported(tmp_path):
    writer = metrics.MetricsWriter(str(tmp_path), trackers=())
    writer.write(1, {"reward/mean": 1.0})
    writer.close()
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]
