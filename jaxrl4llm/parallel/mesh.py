"""The device mesh and multi-host start-up.

One `jax.sharding.Mesh` with the named axes (data, fsdp, expert, tensor) holds the policy,
the reference model and the sampler (sharding.py maps arrays' logical axes onto it). The
expert axis splits a mixture-of-experts model's experts; everything else treats it as one
more data-parallel axis (models/moe.py moves each token to its experts' devices).

    mesh = make_mesh("data:1,fsdp:4,tensor:2")
    mesh = make_mesh("fsdp:2,expert:4")
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging
from jax.sharding import AxisType, Mesh

from jaxrl4llm.parallel import slurm

# Outermost to innermost: the axes whose collectives move most (tensor, then the experts'
# token exchange) get the devices nearest each other.
MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the (data, fsdp, expert, tensor) mesh axes; at most one may be -1 ("the
    rest")."""

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    tensor: int = 1

    @classmethod
    def parse(cls, text: str) -> "MeshSpec":
        """Parses "data:1,fsdp:-1,tensor:1" (":" or "=" both work; missing axes keep defaults)."""
        sizes: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.replace("=", ":").partition(":")
            name = name.strip()
            if not sep or name not in MESH_AXES:
                raise ValueError(
                    f"Bad mesh spec {text!r}: item {item!r} must be AXIS:SIZE with AXIS one of "
                    f"{', '.join(MESH_AXES)}, e.g. --mesh=data:1,fsdp:-1,tensor:1"
                )
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(
                    f"Bad mesh spec {text!r}: size {value!r} of axis {name!r} is "
                    "not an integer (use -1 for 'all remaining devices')."
                ) from None
        return cls(**sizes)

    def resolve(self, num_devices: int) -> tuple[int, ...]:
        """Returns concrete axis sizes whose product is `num_devices`, or raises a clear error."""
        sizes = [self.data, self.fsdp, self.expert, self.tensor]
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError(
                f"Mesh {self} has a size that is 0 or below -1; sizes are positive, "
                "or -1 for 'all remaining devices'."
            )
        if sizes.count(-1) > 1:
            raise ValueError(
                f"Mesh {self} has more than one axis of size -1; at most one axis "
                "may take 'all remaining devices'."
            )
        known = int(np.prod([s for s in sizes if s != -1]))
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(
                    f"Mesh {self}: the fixed axes multiply to {known}, which does not divide the "
                    f"{num_devices} available devices. Change the mesh spec (--mesh)."
                )
            sizes[sizes.index(-1)] = num_devices // known
        if int(np.prod(sizes)) != num_devices:
            raise ValueError(
                f"Mesh {self} needs {int(np.prod(sizes))} devices but {num_devices} are available. "
                f"Make data*fsdp*expert*tensor equal {num_devices}, or set one axis to -1 "
                "(e.g. --mesh=data:1,fsdp:-1,tensor:1)."
            )
        return tuple(sizes)


def make_mesh(spec: MeshSpec | str = MeshSpec(), devices: Sequence[Any] | None = None) -> Mesh:
    """Builds the (data, fsdp, expert, tensor) mesh over `devices` (default: all devices).

    Axis types are Auto (jit in/out shardings drive the partitioning), spelled out because
    `jax.make_mesh` defaults to Explicit axes in jax 0.10.
    """
    if isinstance(spec, str):
        spec = MeshSpec.parse(spec)
    devices = list(jax.devices() if devices is None else devices)
    shape = spec.resolve(len(devices))
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def maybe_initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    auto_detect: bool = False,
) -> bool:
    """Calls `jax.distributed.initialize` when running on several hosts.

    Explicit arguments win; otherwise JAX's own cluster detection (TPU pods, SLURM, ...) or
    the JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID environment variables
    decide; `auto_detect=True` starts it with cluster auto-detection alone (TPU pods, SLURM).
    Under SLURM each process drives all the GPUs its task owns (`slurm.local_device_ids`),
    not jax's default of GPU SLURM_LOCALID alone.
    Returns True when a multi-process runtime was started.
    """
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and "JAX_NUM_PROCESSES" in os.environ:
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator_address is None and num_processes in (None, 1) and not auto_detect:
        return False
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=slurm.local_device_ids(),  # None: jax's own choice
    )
    logging.info(
        "jax.distributed: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True
