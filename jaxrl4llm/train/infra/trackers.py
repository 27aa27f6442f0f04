"""Experiment trackers beside metrics.jsonl (--trackers=tensorboard,wandb,mlflow).

Each tracker gets every record metrics.jsonl gets, under the same names (MLflow refuses some
characters: `eval/math500/avg@16` is `eval/math500/avg_16` there), and the run's config as
hyper-parameters (every flag by name). A resumed run continues the same tracker run: the ids
are kept in WORKDIR/trackers.json. TensorBoard needs no account; Weights & Biases and MLflow
are optional extras (`pip install 'jaxrl4llm[wandb]'`, `'jaxrl4llm[mlflow]'`), imported only
when named, and both work offline: W&B with WANDB_MODE=offline (files under WORKDIR/wandb,
`wandb sync` uploads them later), MLflow into WORKDIR/mlflow.db unless MLFLOW_TRACKING_URI
names a server.

An object-store workdir (gs://): TensorBoard writes its event file in a local folder and
uploads it to WORKDIR/tensorboard after each record; W&B keeps its files in $WANDB_DIR (a
local temporary folder where unset); MLflow needs MLFLOW_TRACKING_URI (its local store is a
SQLite file, which an object store cannot hold).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import uuid
from typing import Any, Mapping, Protocol

from jaxrl4llm.config import paths
from jaxrl4llm.config.errors import UserError
from jaxrl4llm.train.config.groups import PACKAGES as PACKAGES
from jaxrl4llm.train.config.groups import TRACKERS as TRACKERS

IDS_FILE = "trackers.json"
# The W&B project and MLflow experiment (unless WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME say).
PROJECT = "jaxrl4llm"
_MLFLOW_BAD_CHARS = re.compile(r"[^/\w.\- :]")
_MLFLOW_BATCH = 100  # MLflow's limit of params (and of metrics, 1000) per log_batch


class Tracker(Protocol):
    def write(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def open_trackers(
    workdir: str, names: tuple[str, ...], hparams: Mapping[str, Any]
) -> list[Tracker]:
    """The trackers `names`, each continuing the run whose id WORKDIR/trackers.json holds (a
    new one otherwise, its id saved there)."""
    path = paths.join(workdir, IDS_FILE)
    ids: dict[str, str] = {}
    if paths.exists(path):
        ids = json.loads(paths.read_text(path))
    trackers: list[Tracker] = []
    for name in names:
        if name == "tensorboard":
            trackers.append(TensorBoard(paths.join(workdir, "tensorboard")))
        elif name == "wandb":
            trackers.append(WandB(workdir, ids.setdefault("wandb", uuid.uuid4().hex[:12]), hparams))
        else:
            mlflow = MLflow(workdir, ids.get("mlflow"), hparams)
            ids["mlflow"] = mlflow.run_id
            trackers.append(mlflow)
    if set(names) - {"tensorboard"}:
        paths.write_text(path, json.dumps(ids, indent=2, sort_keys=True))
    return trackers


class TensorBoard:
    """Scalars to a TensorBoard event file, written and flushed with each JSONL record.

    tensorboardX's SummaryWriter hands events to a background thread whose queue flush() does
    not drain, so a killed run lost its last steps; its synchronous EventsWriter does not.
    An object-store `logdir`: the file is written locally and uploaded after each flush.
    """

    def __init__(self, logdir: str):
        from tensorboardX.event_file_writer import EventsWriter

        self._remote = logdir if paths.is_remote(logdir) else None
        local = tempfile.mkdtemp(prefix="tensorboard-") if self._remote else logdir
        os.makedirs(local, exist_ok=True)
        self._local = local
        self._writer = EventsWriter(os.path.join(local, "events"))

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        from tensorboardX.proto import event_pb2, summary_pb2

        values = [
            summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()
        ]
        self._writer.write_event(
            event_pb2.Event(
                wall_time=time.time(), step=int(step), summary=summary_pb2.Summary(value=values)
            )
        )
        self._writer.flush()
        self._upload()

    def _upload(self) -> None:
        if self._remote is None:
            return
        for name in os.listdir(self._local):
            with open(os.path.join(self._local, name), "rb") as f:
                paths.write_bytes(paths.join(self._remote, name), f.read())

    def close(self) -> None:
        self._writer.close()
        self._upload()


class WandB:
    """A Weights & Biases run (id kept in the workdir; resumed with resume="allow")."""

    def __init__(self, workdir: str, run_id: str, hparams: Mapping[str, Any]):
        import wandb

        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            id=run_id,
            resume="allow",
            dir=_local_dir(workdir, os.environ.get("WANDB_DIR")),
            name=_run_name(workdir),
            config=dict(hparams),
        )

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=int(step))

    def close(self) -> None:
        self._run.finish()


class MLflow:
    """An MLflow run through the tracking client (no global active run): the config as
    params at creation, metrics in batches; a resumed run logs into the same run id."""

    def __init__(self, workdir: str, run_id: str | None, hparams: Mapping[str, Any]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None and paths.is_remote(workdir):
            raise UserError(
                f"--trackers=mlflow with --workdir={workdir}: MLflow's local store is a SQLite "
                "file, which an object store cannot hold. Set MLFLOW_TRACKING_URI to a "
                "tracking server, or drop mlflow from --trackers."
            )
        uri = uri or "sqlite:///" + os.path.join(os.path.abspath(workdir), "mlflow.db")
        self._client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
            experiment = self._client.get_experiment_by_name(name)
            experiment_id = (
                experiment.experiment_id
                if experiment
                else self._client.create_experiment(
                    name, artifact_location=os.path.join(os.path.abspath(workdir), "mlartifacts")
                )
            )
            run_id = self._client.create_run(experiment_id, run_name=_run_name(workdir)).info.run_id
            params = [Param(_mlflow_name(k), str(v)[:6000]) for k, v in sorted(hparams.items())]
            for i in range(0, len(params), _MLFLOW_BATCH):
                self._client.log_batch(run_id, params=params[i : i + _MLFLOW_BATCH])
        else:
            self._client.update_run(run_id, status="RUNNING")
        self.run_id: str = run_id

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_name(k), float(v), now, int(step)) for k, v in scalars.items()]
        for i in range(0, len(metrics), 10 * _MLFLOW_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 10 * _MLFLOW_BATCH])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _mlflow_name(name: str) -> str:
    return _MLFLOW_BAD_CHARS.sub("_", name)


def _run_name(workdir: str) -> str:
    return paths.basename(paths.absolute(workdir))


def _local_dir(workdir: str, override: str | None) -> str:
    """Where a tracker's own files go: the workdir, or (an object store) `override` or a
    local temporary folder."""
    if not paths.is_remote(workdir):
        return workdir
    return override or tempfile.mkdtemp(prefix="wandb-")
