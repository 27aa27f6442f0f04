"""How a run ends: its exit codes and the errors a user (or a scheduler) acts on.

`python -m experiments.train` exits with

  0   EXIT_FINISHED     trained to --num_steps; the final checkpoint is saved
  1   (Python's own)    an unexpected error, a bug: the traceback is printed
  2   EXIT_USER_ERROR   a bad flag, data source or workdir (DataError, WorkdirInUseError,
                        ResumeMismatchError, CheckpointError, a flag check): one line
                        naming the input and the fix, no traceback
  3   EXIT_DIVERGED     training stopped on non-finite values (TrainingDivergedError,
                        NonFiniteStateError): one line; no non-finite state was saved
  75  EXIT_PREEMPTED    SIGTERM: the step's checkpoint was saved; rerun the same command to
                        resume (75 is sysexits' EX_TEMPFAIL, "try again later", so a
                        scheduler can requeue on it; a run killed outright shows as 143 / -15)

docs/reliability.md lists the tests behind each.
"""

from __future__ import annotations

from jaxrl4llm.config.errors import (  # noqa: F401
    EXIT_DIVERGED,
    EXIT_FINISHED,
    EXIT_PREEMPTED,
    EXIT_USER_ERROR,
    UserError,
)


class TrainingDivergedError(RuntimeError):
    """Too many consecutive steps whose every update was non-finite (skipped): the state is
    stuck, so the run stops; the message names the steps, the last checkpoint and the fix."""


class ResumeMismatchError(UserError, ValueError):
    """The workdir was trained with settings a resume cannot change (model, algorithm, ...):
    the message names each flag with its saved and new value, and the fix."""
