"""The policy's optimizer settings (--learning_rate, --lr_schedule, the Adam knobs): a config
group of TrainConfig; train/update/state.py builds the optax optimizer from it."""

from __future__ import annotations

import dataclasses

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with warmup, a decay schedule and global-norm gradient clipping.

    learning_rate: AdamW peak learning rate.
    warmup_steps: Linear warmup, in optimizer updates.
    schedule: Decay after warmup: constant, cosine or linear (to 0 over decay_steps).
    decay_steps: Optimizer updates to decay over (0 = constant after warmup).
    weight_decay: AdamW weight decay.
    max_grad_norm: Global-norm gradient clip (0 = off).
    b1: Adam beta1 (first-moment decay).
    b2: Adam beta2 (second-moment decay).
    eps: Adam epsilon.
    """

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    schedule: str = "constant"  # constant | cosine | linear (decay to 0 over decay_steps)
    decay_steps: int = 0  # optimizer updates to decay over; 0 = constant after warmup
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 disables clipping
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def validate(self) -> None:
        if self.learning_rate <= 0:
            raise ValueError(f"--learning_rate must be positive, got {self.learning_rate}.")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--lr_schedule={self.schedule!r}: choose constant, cosine or linear.")
        if self.warmup_steps < 0 or self.decay_steps < 0 or self.max_grad_norm < 0:
            raise ValueError("--warmup_steps, --decay_steps and --max_grad_norm must be >= 0.")
        if self.weight_decay < 0:
            raise ValueError(f"--weight_decay={self.weight_decay} must be >= 0.")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(
                f"--adam_b1={self.b1} and --adam_b2={self.b2} must be in [0, 1) "
                "(defaults 0.9, 0.999)."
            )
        if self.eps <= 0:
            raise ValueError(f"--adam_eps={self.eps} must be > 0 (default 1e-8).")
