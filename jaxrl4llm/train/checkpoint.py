"""Orbax checkpoints of the whole run: train state (params, optimizer, step, rng) + data state.

A checkpoint is everything needed for an exact resume: restoring step N and running on
gives the same parameters and metrics as never having stopped.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:
    """Saves every `every` steps (and on demand), keeps the last `keep`, restores the latest."""

    def __init__(self, directory: str, every: int, keep: int = 3):
        if every <= 0:
            raise ValueError(f"--checkpoint_every must be positive, got {every}.")
        self.directory = os.path.abspath(directory)
        self._every = every
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=False),
            item_names=("state", "data"),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        return step % self._every == 0

    def save(self, step: int, state: Any, data_state: dict) -> None:
        if self._manager.latest_step() == step:
            return  # already saved (e.g. periodic save followed by the final one)
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))
        self._manager.wait_until_finished()
        logging.info("Saved checkpoint %d to %s", step, self.directory)

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restores onto the shardings of `abstract_state` (a pytree of jax.ShapeDtypeStruct:
        `abstract_like(state)` of a state from `state.create_state`, or
        `state.abstract_state`), so optimizer moments come back laid out like their params."""
        step = self._manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"No checkpoint in {self.directory} to restore.")
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return restored["state"], dict(restored["data"])

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) for restoring a tree shaped like `tree`."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree)


def load_trained_policy(workdir: str, step: int | None = None, mesh: Any = None
                        ) -> tuple[Any, Any, Any, Any]:
    """(train config, model config, trained params, tokenizer) of a training workdir.

    The base model named in WORKDIR/config.json gives the architecture and tokenizer; the
    latest (or `step`) checkpoint gives the parameters.
    """
    from jaxrl4llm.models import registry
    from jaxrl4llm.train.config import TrainConfig, param_dtype
    from jaxrl4llm.train.state import abstract_state

    config_path = os.path.join(workdir, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{workdir!r} has no config.json: pass a training --workdir.")
    with open(config_path) as f:
        config = TrainConfig.from_json(f.read())
    model_config, params, tokenizer = registry.load_model(
        config.model, mesh=mesh, dtype=param_dtype(config.param_dtype))
    # Restored onto the params' layout, optimizer moments included.
    abstract = abstract_state(params, config.optimizer, config.seed)
    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every=1)
    try:
        if checkpointer.latest_step() is None:
            raise FileNotFoundError(f"{workdir!r} has no checkpoint yet.")
        state, _ = checkpointer.restore(abstract, step)
    finally:
        checkpointer.close()
    return config, model_config, state.params, tokenizer


class PreemptionFlag:
    """Turns SIGTERM (preemption) into a flag the loop polls: save, then exit cleanly."""

    def __init__(self):
        self._event = threading.Event()
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):  # noqa: ARG002 (signal handler signature)
        logging.warning("SIGTERM received: saving a checkpoint after this step, then exiting.")
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def restore_handler(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
