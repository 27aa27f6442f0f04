"""Preflight a training run on the machine it will run on: one table, exit 0 or 2.

    python -m experiments.doctor --flagfile=experiments/configs/quickstart.flags
    python -m experiments.doctor --flagfile=... --mesh=data:2,fsdp:-1,tensor:1 --distributed

It takes every training flag (a training flagfile works as is) and checks, without loading
weights or compiling anything:

  devices        what jax sees: platform, device kind, devices, hosts (joins a multi-host
                 run first with --distributed)
  mesh           --mesh divides the devices
  flags          the whole config is valid (train.config.checks.validate, the trainer's own check)
  model          --model is found (registered, a local folder / .gguf, or the hub cache)
  host memory    the host can hold the model while it loads (a float32 copy of the weights)
  disk           the workdir's free space holds --keep_checkpoints + 1 checkpoints (params
                 and Adam moments; a save in flight beside the kept ones); gs:// is not checked
  data           the training source opens and has rows
  reward workers the verifier pool's worker processes start and answer
  device memory  the planner's estimate of the largest program (jaxrl4llm/planner/estimate.py)
                 against the device's memory, 10% headroom (GPU / TPU; CPUs use host memory)

A failed check prints FAIL with the reason and the fix; the exit code is 2 when any check
failed, else 0. A "warn" does not fail the run.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import TYPE_CHECKING, Any, Callable

from absl import flags

from experiments import train as _train  # defines the training flags (shared flagfiles)
from jaxrl4llm.config import cli, paths
from jaxrl4llm.config.errors import EXIT_USER_ERROR, UserError, one_line
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.config.checks import validate

if TYPE_CHECKING:  # jax and the models load after the flags are parsed
    from jax.sharding import Mesh

    from jaxrl4llm.models.config import ModelConfig

for _name in _train.FLAG_NAMES:
    flags.declare_key_flag(_name)

GIB = 2**30
HEADROOM = 0.9  # a program may use 90% of a device's memory (as tools/plan.py)
OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "-"


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    status: str  # OK, WARN, FAIL or SKIP (not checked: what it needs failed)
    detail: str


@dataclasses.dataclass
class _Facts:
    """What one check finds and a later one uses."""

    devices: list
    mesh: Mesh | None = None
    model_config: ModelConfig | None = None


def run_checks(
    config: TrainConfig, devices: list, disk_usage: Callable[[str], Any] = shutil.disk_usage
) -> list[Check]:
    """Every check of the module docstring, in order; each one's failure is its row, never an
    exception."""
    facts = _Facts(devices=list(devices))
    steps: list[tuple[str, Callable[[], tuple[str, str]]]] = [
        ("devices", lambda: _devices(facts)),
        ("mesh", lambda: _mesh(config, facts)),
        ("flags", lambda: _flags(config, facts)),
        ("model", lambda: _model(config, facts)),
        ("host memory", lambda: _host_memory(facts)),
        ("disk", lambda: _disk(config, facts, disk_usage)),
        ("data", lambda: _data(config)),
        ("reward workers", lambda: _reward_workers(config)),
        ("device memory", lambda: _device_memory(config, facts)),
    ]
    checks = []
    for name, check in steps:
        try:
            status, detail = check()
        except (UserError, ValueError, OSError) as exc:
            status, detail = FAIL, one_line(exc).removeprefix("Error: ")
        checks.append(Check(name, status, detail))
    return checks


def _devices(facts: _Facts) -> tuple[str, str]:
    import jax

    d = facts.devices[0]
    return OK, (
        f"{len(facts.devices)} x {d.platform} ({d.device_kind}), "
        f"{jax.local_device_count()} on this host, {jax.process_count()} host(s)"
    )


def _mesh(config: TrainConfig, facts: _Facts) -> tuple[str, str]:
    from jaxrl4llm import parallel

    facts.mesh = parallel.make_mesh(config.run.mesh, facts.devices)
    shape = dict(zip(facts.mesh.axis_names, facts.mesh.devices.shape))
    return OK, f"--mesh={config.run.mesh} -> " + ", ".join(f"{k}:{v}" for k, v in shape.items())


def _flags(config: TrainConfig, facts: _Facts) -> tuple[str, str]:
    validate(config, len(facts.devices))
    return OK, (
        f"batch {config.batch_size} rows ({config.rollout.prompts_per_step} prompts x "
        f"{config.rollout.group_size}), {config.updates_per_step} update(s) per step"
    )


def _model(config: TrainConfig, facts: _Facts) -> tuple[str, str]:
    from jaxrl4llm.models import registry
    from jaxrl4llm.models.config import ModelConfig
    from jaxrl4llm.models.gguf_file import GGUFSource

    path = registry.resolve(config.model.name)
    facts.model_config = (
        GGUFSource(path).config() if path.endswith(".gguf") else ModelConfig.from_hf_config(path)
    )
    millions = facts.model_config.num_params / 1e6
    return OK, f"{config.model.name}: {millions:.1f}M parameters at {path}"


def _param_bytes(config: TrainConfig, facts: _Facts) -> int:
    from jaxrl4llm.train.config import param_dtype

    size = param_dtype(config.model.param_dtype)(0).dtype.itemsize
    assert facts.model_config is not None  # the model check ran first
    return facts.model_config.num_params * size


def _host_memory(facts: _Facts) -> tuple[str, str]:
    available = _available_host_bytes()
    if facts.model_config is None:
        return SKIP, f"{available / GIB:.1f} GiB available; the model's size is unknown"
    need = facts.model_config.num_params * 4
    status = OK if available >= need else WARN
    return status, (
        f"{available / GIB:.1f} GiB available, loading the weights needs "
        f"~{need / GIB:.2f} GiB (a float32 copy)"
    )


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def checkpoint_bytes(config: TrainConfig, param_bytes: int) -> int:
    """One checkpoint: the params and AdamW's two moments (in the params' dtype), twice with
    PPO's critic."""
    return 3 * param_bytes * (2 if config.needs_critic else 1)


def _disk(config: TrainConfig, facts: _Facts, disk_usage: Callable[[str], Any]) -> tuple[str, str]:
    workdir = config.run.workdir
    if paths.is_remote(workdir):
        return _object_store(workdir)
    if facts.model_config is None:
        return SKIP, "the checkpoint size needs --model"
    existing = os.path.abspath(workdir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    free = disk_usage(existing).free
    kept = config.run.keep_checkpoints + 1
    need = kept * checkpoint_bytes(config, _param_bytes(config, facts))
    detail = (
        f"{free / GIB:.2f} GiB free in {existing}; {kept} checkpoints "
        f"(--keep_checkpoints={config.run.keep_checkpoints} + one being saved) need "
        f"{need / GIB:.2f} GiB"
    )
    if free < need:
        return FAIL, (
            detail + ": free space, or lower --keep_checkpoints, or use another --workdir"
        )
    return OK, detail


def _object_store(workdir: str) -> tuple[str, str]:
    """An object-store workdir: a probe object written and deleted (free space has no
    meaning there); a failure names the missing client or credentials."""
    probe = paths.join(workdir, f".doctor-probe-{os.getpid()}")
    try:
        paths.write_text(probe, "jaxrl4llm doctor probe")
        paths.remove(probe)
    except ImportError as exc:
        return FAIL, (
            f"{workdir}: no client for this object store ({one_line(exc)}); install it: "
            "pip install 'jaxrl4llm[gcs]' (gcsfs) for gs://"
        )
    except Exception as exc:  # noqa: BLE001 (any client error is the finding)
        text = one_line(exc)
        auth = any(w in text.lower() for w in ("credential", "401", "403", "unauthorized"))
        fix = (
            "the credentials cannot write there: run `gcloud auth application-default login` "
            "or set GOOGLE_APPLICATION_CREDENTIALS to a key with storage.objects.create and "
            "storage.objects.delete on the bucket"
            if auth
            else "check that the bucket exists and this machine reaches it"
        )
        return FAIL, f"{workdir}: could not write a probe object ({text[:200]}): {fix}"
    return OK, f"{workdir}: object storage, wrote and deleted a probe object"


def _data(config: TrainConfig) -> tuple[str, str]:
    from jaxrl4llm.data import make_source

    d = config.data
    source = make_source(d.source, split="train", revision=d.revision, **d.field_names)
    if not len(source):
        return FAIL, f"--data={d.source} has no rows in its train split"
    return OK, f"--data={d.source}: {len(source)} prompts"


def _reward_workers(config: TrainConfig) -> tuple[str, str]:
    from jaxrl4llm.rewards import RewardFn

    with RewardFn("auto", config.reward) as reward_fn:
        results = reward_fn.pool.run([(os.getpid, ())] * config.reward.num_workers)
    bad = [r for r in results if r.status != "ok"]
    if bad:
        return FAIL, (
            f"{len(bad)} of {len(results)} verifier jobs ended {bad[0].status}: "
            f"{bad[0].value}; check --memory_limit_mb and --reward_workers"
        )
    return OK, (
        f"--reward_workers={config.reward.num_workers}: the pool started and ran "
        f"{len(results)} job(s) in worker processes"
    )


def _device_memory(config: TrainConfig, facts: _Facts) -> tuple[str, str]:
    if facts.mesh is None or facts.model_config is None:
        return SKIP, "needs a valid --mesh and --model"
    stats = facts.devices[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    peak, program = peak_estimate(config, facts.model_config, facts.mesh, facts.devices[0].platform)
    if not limit:
        return SKIP, (
            f"{facts.devices[0].platform} reports no device memory; the largest "
            f"program ({program}) needs ~{peak / GIB:.2f} GiB per device"
        )
    detail = (
        f"the largest program ({program}) needs ~{peak / GIB:.2f} GiB of "
        f"{limit / GIB:.1f} GiB per device"
    )
    if peak > HEADROOM * limit:
        return FAIL, (
            detail + f" (over {HEADROOM:.0%}): shard more (--mesh fsdp / tensor), "
            "lower --micro_batch_size or --rollout_micro_batch, or see tools/plan.py"
        )
    return OK, detail


def peak_estimate(
    config: TrainConfig, model_config: ModelConfig, mesh: Mesh, platform: str
) -> tuple[float, str]:
    """(bytes, program) of the planner's per-device estimate of the step's largest program:
    the update beside the reference params, the rollout and the logprobs pass beside the
    optimizer state."""
    from jaxrl4llm.planner.estimate import CPU_GATHER_BYTES, Estimate

    est = Estimate(
        config, model_config, mesh, gather_bytes=CPU_GATHER_BYTES if platform == "cpu" else 0
    )
    ref = est.Pb if config.needs_reference else 0.0
    chunks = (
        config.batch_size // config.rollout.rollout_micro_batch
        if config.rollout.rollout_micro_batch
        else 1
    )
    group = config.rollout.group_size
    programs = {
        "update": est.update(group, ref),
        "rollout": est.rollout(chunks, 2 * est.Pb + ref),
        "logprobs": est.logprobs(chunks, group, 2 * est.Pb + ref),
    }
    name = max(programs, key=programs.__getitem__)
    return programs[name], name


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{'check':{width}s}  status  detail", f"{'-' * width}  ------  ------"]
    lines += [f"{c.name:{width}s}  {c.status:6s}  {c.detail}" for c in checks]
    return "\n".join(lines)


def main(argv):
    del argv  # cli.run refuses positional arguments
    cli.quiet_logs()
    config = _train.config_from_flags()
    from jaxrl4llm import parallel

    parallel.maybe_initialize_distributed(auto_detect=config.run.distributed)
    import jax

    checks = run_checks(config, jax.devices())
    print(format_table(checks))
    failed = [c.name for c in checks if c.status == FAIL]
    if failed:
        print(f"\n{len(failed)} check(s) failed: {', '.join(failed)}.")
        return EXIT_USER_ERROR
    print("\nEvery check passed.")
    return 0


if __name__ == "__main__":
    cli.run(main)
