"""The step's programs lowered for the topology's platform (tools/plan.py --target_kernels).

The plan compiles every program with XLA's CPU compiler on simulated devices, which cannot
compile the TPU kernels the run calls: JAX's Pallas splash attention in the prefill, the
teacher-forced passes and the update (forward and backward), and its Pallas paged attention
kernel in the paged engine's decode. It plans the chunked attention and the page gather in
their place. Here each program is traced as on the TPU (parallel.lowering_for: every choice
the code makes by platform, as the run makes it there) and exported for it with jax.export,
which lowers each Pallas kernel to Mosaic: a kernel that cannot take the run's shapes,
dtypes or mesh fails here, on a CPU host, instead of on the pod. The TPU compiler's own
passes (Mosaic's compilation of each kernel, the compiled program's memory) are not run.

GPU topologies are refused: on a host without CUDA, JAX refuses the cuDNN attention the run
calls there when it traces it.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any, Callable, Sequence

from jaxrl4llm import parallel
from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.planner import programs
from jaxrl4llm.planner import rollout as rollout_lib
from jaxrl4llm.planner.topology import Topology
from jaxrl4llm.train.config import TrainConfig

# A Pallas kernel's custom call in the exported module names it.
_KERNEL = re.compile(r'kernel_name = "([^"]+)"')


@dataclasses.dataclass(frozen=True)
class Lowered:
    """One program exported for the platform: the Pallas kernels it calls (name -> custom
    calls of it in the module), or why it did not lower."""

    program: str
    kernels: dict[str, int]
    error: str = ""


def target_kernels(
    config: TrainConfig, model_config: ModelConfig, topo: Topology, devices: Sequence[Any]
) -> list[Lowered]:
    """Every program of one step of `config` but `create` (no kernel), exported for the
    topology's platform on a mesh of `devices` (its simulated devices)."""
    check_topology(topo)
    with parallel.lowering_for(topo.backend):
        s = programs.setup(config, model_config, topo, devices)
        s = dataclasses.replace(s, platform=parallel.EXPORT_PLATFORMS[topo.backend])
        B, P, N = s.rows
        made: dict[str, Callable[[], Any]] = {
            "rollout": lambda: rollout_lib.lower_rollout(s, P),
            "logprobs": lambda: programs.lower_logprobs(s, B, P, N),
            "update": lambda: programs.lower_update(s, P, N),
        }
        if s.critic_state is not None:
            made["critic values"] = lambda: programs.lower_values(s, B, P, N)
            made["critic update"] = lambda: programs.lower_critic_update(s, P, N)
        return [_lowered(name, make) for name, make in made.items()]


def check_topology(topo: Topology) -> None:
    """Refuses a topology whose kernels cannot be lowered here (FlagError: module docstring)."""
    if topo.backend != "tpu":
        why = {
            "gpu": "whose cuDNN attention JAX lowers only where CUDA is installed",
            "cpu": "whose programs the plan compiles already",
        }[topo.backend]
        raise FlagError(
            f"--target_kernels lowers the TPU kernels; --topology={topo.name} runs on "
            f"{topo.backend}, {why}. Use a TPU topology (e.g. v5p-64) or drop --target_kernels."
        )


def _lowered(name: str, make: Callable[[], Any]) -> Lowered:
    try:
        text = make().mlir_module()
    except Exception as e:  # noqa: BLE001  (any failure to lower is the finding, reported)
        return Lowered(name, {}, f"{type(e).__name__}: {str(e).splitlines()[0][:400]}")
    return Lowered(name, dict(collections.Counter(_KERNEL.findall(text))))


def print_target(lowered: list[Lowered], topo: Topology) -> None:
    """One line per program: the kernels it calls on the platform, or its error."""
    print(f"\nLowered for {topo.backend} (jax.export; the kernels the CPU compile replaces):")
    for row in lowered:
        kernels = ", ".join(f"{k} x{n}" for k, n in sorted(row.kernels.items())) or "none"
        print(f"  {row.program:14s} {('DOES NOT LOWER: ' + row.error) if row.error else kernels}")


def not_lowering_line(lowered: list[Lowered], topo: Topology) -> str | None:
    """The line tools/plan.py ends with when some program does not lower (else None)."""
    failed = [row.program for row in lowered if row.error]
    return f"DOES NOT LOWER for {topo.backend}: {', '.join(failed)}" if failed else None
