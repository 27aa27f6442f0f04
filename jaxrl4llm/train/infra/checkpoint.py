"""Orbax checkpoints of the whole run: train state (params, optimizer, step, rng) + data state.

A checkpoint is everything needed for an exact resume: restoring step N and running on
gives the same parameters and metrics as never having stopped.

Integrity: a save refuses a non-finite state, and writes STEP/integrity.json (per-array
digests, train/infra/integrity.py) once orbax has finalized the step. A restore checks the digests
and finiteness; a damaged or unreadable step is set aside (renamed STEP.corrupt-TIME) with a
warning and the previous one is tried, down to a clear error when none is usable.
"""

from __future__ import annotations

import errno
import signal
import threading
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from jaxrl4llm.config import paths
from jaxrl4llm.config.errors import UserError
from jaxrl4llm.train.config import TrainConfig
from jaxrl4llm.train.infra import integrity


class CheckpointError(UserError, RuntimeError):
    """No usable checkpoint; the message names the folder, each step's problem and the fix."""


class RunNotFoundError(CheckpointError, FileNotFoundError):
    """A folder that is not a training workdir, or one without a checkpoint yet (also a
    FileNotFoundError, as callers that predate CheckpointError catch)."""


class NonFiniteStateError(ValueError):
    """The state to save holds NaN or inf (a diverged update): it is never written."""


def _disk_full(error: BaseException | None) -> bool:
    """Whether a save failed for want of disk space (orbax reports ENOSPC from its writer
    threads as a ValueError naming RESOURCE_EXHAUSTED / "No space left on device"), looking
    through the chain of causes."""
    while error is not None:
        if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or (
            "No space left on device" in str(error)
        ):
            return True
        error = error.__cause__ or error.__context__
    return False


class Checkpointer:
    """Saves every `every` steps (and on demand), keeps the last `keep`, restores the latest.

    `keep` counts the latest steps, so the run's final save (always its latest step) is
    always kept and a rerun resumes from it. Orbax deletes the older steps only once the new
    one is finalized: during a save, `keep` + 1 steps are on disk.
    """

    def __init__(self, directory: str, every: int, keep: int = 3):
        if every <= 0:
            raise ValueError(f"--checkpoint_every must be positive, got {every}.")
        self.directory = paths.absolute(directory)
        self._every = every
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=False
            ),
            item_names=("state", "data"),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        return step % self._every == 0

    def _step_dir(self, step: int) -> str:
        return paths.join(self.directory, str(step))

    def save(self, step: int, state: Any, data_state: dict) -> None:
        if self._manager.latest_step() == step:
            return  # already saved (e.g. periodic save followed by the final one)
        saved = integrity.fingerprint(state)
        if saved.nonfinite:
            raise NonFiniteStateError(
                f"Refusing to save checkpoint {step} to {self.directory}: non-finite values in "
                f"{', '.join(saved.nonfinite[:5])}. The last good checkpoint is "
                f"{self._manager.latest_step()}. The update diverged: lower the learning rate, "
                "check the rewards for NaN / inf, or resume from that checkpoint."
            )
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
                ),
            )
            self._manager.wait_until_finished()  # finalized: the step folder has its final name
        except (OSError, ValueError) as e:
            if not _disk_full(e):
                raise
            self._remove_partial(step)
            free = paths.free_gib(self.directory) or 0.0
            raise CheckpointError(
                f"Could not write checkpoint {step} to {self.directory}: no space left on the "
                f"device ({free:.1f} GiB free after removing the partial step). Free space "
                "there (or point --workdir elsewhere), or keep fewer / rarer checkpoints "
                "(--keep_checkpoints, --checkpoint_every); rerunning the same command resumes "
                f"from checkpoint {self._manager.latest_step()}."
            ) from e
        if jax.process_index() == 0:
            integrity.write_record(self._step_dir(step), step, saved, data_state)
        logging.info("Saved checkpoint %d to %s", step, self.directory)

    def _remove_partial(self, step: int) -> None:
        """Deletes what a failed save of `step` left (orbax's temporary step folder)."""
        for name in paths.listdir(self.directory):
            if name.startswith(f"{step}.orbax-checkpoint-tmp"):
                paths.remove(paths.join(self.directory, name))

    def _check(self, step: int, state: Any, data_state: dict) -> str | None:
        """What is wrong with a restored step (digests, finiteness), else None."""
        record_dir = self._step_dir(step)
        try:
            record = integrity.read_record(record_dir)
        except (OSError, ValueError) as exc:
            return f"unreadable {integrity.RECORD_NAME}: {exc}"
        found = integrity.problems(record, integrity.fingerprint(state), data_state)
        if record is None and not found:
            logging.warning(
                "Checkpoint %s has no %s (saved by an older version): restored "
                "without checking its bytes.",
                record_dir,
                integrity.RECORD_NAME,
            )
        return "; ".join(found) or None

    def restore(
        self, abstract_state: Any, step: int | None = None, *, set_aside: bool = True
    ) -> tuple[Any, dict]:
        """Restores onto the shardings of `abstract_state` (a pytree of jax.ShapeDtypeStruct:
        `abstract_like(state)` of a state from `state.create_state`, or
        `state.abstract_state`), so optimizer moments come back laid out like their params:
        `step`, else the latest usable step. Damaged later steps are warned about and, with
        `set_aside` (a run that will save again), renamed out of the way."""
        steps = sorted(self._manager.all_steps(), reverse=True) if step is None else [step]
        if not steps:
            raise FileNotFoundError(f"No checkpoint in {self.directory} to restore.")
        failures: list[tuple[int, str]] = []
        for candidate in steps:
            problem: str | None
            try:
                restored = self._manager.restore(
                    candidate,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
                    ),
                )
                state, data_state = restored["state"], dict(restored["data"])
            except Exception as exc:  # noqa: BLE001 - tensorstore / JSON / orbax raise many types
                problem = f"{type(exc).__name__}: {exc}"
            else:
                problem = self._check(candidate, state, data_state)
            if problem is None:
                if set_aside:
                    self._set_aside([bad for bad, _ in failures])
                return state, data_state
            reason = " ".join(problem.split())[:400]
            failures.append((candidate, reason))
            logging.warning(
                "Checkpoint %s is unusable (%s)%s",
                self._step_dir(candidate),
                reason,
                "; falling back to the previous one." if candidate != steps[-1] else ".",
            )
        detail = "; ".join(f"step {s}: {reason}" for s, reason in failures)
        raise CheckpointError(
            f"No usable checkpoint in {self.directory} ({detail}). If the files were damaged "
            f"(disk full, a copy cut short), delete those step folders, or the whole "
            f"{self.directory} to start over; if the model or its settings changed, train in "
            "a new --workdir."
        )

    def _set_aside(self, steps: list[int]) -> None:
        """Renames damaged steps out of orbax's way, so those steps can be saved again."""
        if not steps:
            return
        if jax.process_index() == 0:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for bad in steps:
                if paths.isdir(self._step_dir(bad)):
                    paths.rename(self._step_dir(bad), f"{self._step_dir(bad)}.corrupt-{stamp}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("checkpoint set-aside")
        self._manager.reload()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with shardings) for restoring a tree shaped like `tree`."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree,
    )


def read_run_config(workdir: str) -> TrainConfig:
    """The settings a training run saved in WORKDIR/config.json (the trainer writes it before
    its first step); a RunNotFoundError / CheckpointError naming the folder and the fix when
    it is not a training workdir or the file cannot be read."""
    path = paths.join(workdir, "config.json")
    if not paths.isdir(workdir):
        raise RunNotFoundError(
            f"{workdir!r} does not exist: pass the --workdir of a training "
            "run (python -m experiments.train writes it)."
        )
    if not paths.isfile(path):
        raise RunNotFoundError(
            f"{workdir!r} has no config.json, so it is not a training "
            "workdir: pass the --workdir a python -m experiments.train run "
            "wrote to."
        )
    try:
        return TrainConfig.from_json(paths.read_text(path))
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointError(
            f"Cannot read the run's settings from {path} ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]}): it is not the config.json the trainer "
            "wrote. Restore that file, or pass the --workdir of another training run."
        ) from exc


def saved_steps(workdir: str) -> list[int]:
    """The steps saved in WORKDIR/checkpoints, ascending (finalized step folders only)."""
    folder = paths.join(workdir, "checkpoints")
    return sorted(int(name) for name in paths.listdir(folder) if name.isdigit())


def checkpoint_step(workdir: str, step: int | None = None) -> int:
    """`step` if WORKDIR holds that checkpoint, else (None) its latest; a RunNotFoundError /
    CheckpointError naming the saved steps when there is none / not that one."""
    steps = saved_steps(workdir)
    if not steps:
        raise RunNotFoundError(_no_checkpoint(workdir))
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointError(
            f"{workdir!r} holds no checkpoint of step {step}: it has steps "
            f"{', '.join(map(str, steps))}. Pass one of them (or no step: the latest)."
        )
    return step


def _no_checkpoint(workdir: str) -> str:
    return (
        f"{workdir!r} has no checkpoint yet (no step folder in "
        f"{paths.join(workdir, 'checkpoints')}): train it for --checkpoint_every steps "
        "first, or evaluate the base model with --model."
    )


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

    def poll(self) -> bool:
        """Whether to save and stop after this step: SIGTERM on any host. Every host calls it
        once per step and gets the same answer (one tiny all-gather), since the save and the
        next step's collectives need every host: a host that stopped alone would leave the
        others waiting. A host that did not get the signal then counts as preempted too."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.array(self.requested))
            if bool(np.asarray(flags).any()):
                self._event.set()
        return self.requested

    def restore_handler(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
