"""The errors a user fixes by changing an input, and the exit codes of every entry point.

Every failure caused by the user's input (a flag, a data source, a workdir, a checkpoint, a
model name, a missing optional dependency) raises a `UserError` (or a subclass): its message
names the input and the fix. The entry points (`experiments.train`, `experiments.evaluate`,
`experiments.study`, the scripts in tools/) turn it into exit code 2 and that one line, with
no traceback. This module sits at the bottom of the layers: every package may import it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

EXIT_FINISHED = 0
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_PREEMPTED = 75


class UserError(Exception):
    """A failure the user fixes by changing an input; the message names it and the fix."""


class FlagError(UserError, ValueError):
    """A flag value that is out of range, of the wrong type, or inconsistent with another."""


class ModelError(UserError, ValueError):
    """A model name or folder that cannot be loaded (unknown name, missing files, offline)."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """A model name that is neither registered, nor a model folder or file, nor reachable on
    the Hugging Face Hub (nor in its cache)."""


class DependencyError(UserError, ImportError):
    """An optional dependency that a feature needs is not installed; the message gives the
    install command."""


def one_line(exc: BaseException) -> str:
    """The message an entry point prints for a user error: `Error: ...` on one line."""
    return "Error: " + " ".join(str(exc).split())


@contextlib.contextmanager
def flag_errors() -> Iterator[None]:
    """A ValueError raised by a config check (its message names the flag) as a FlagError."""
    try:
        yield
    except UserError:
        raise
    except ValueError as exc:
        raise FlagError(str(exc)) from exc
