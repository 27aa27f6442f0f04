"""The one record type every source yields: {prompt, answer, metadata}."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxrl4llm.config.errors import UserError


class DataError(UserError, ValueError):
    """Bad user data: the message names the file, the line / row and the field, and the fix."""


@dataclasses.dataclass(frozen=True)
class Record:
    prompt: str  # the question, without any instruction or chat template
    answer: str  # the reference answer the verifier compares against
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # metadata["task"] picks the verifier ("math", "arithmetic", "countdown", "knights_knaves");
    # task-specific fields (countdown numbers/target, knights_knaves names/solution) live here too.

    # metadata is a dict; records are values, not keys. (mypy rejects None for object's
    # __hash__, though None is how Python marks a class unhashable: python/mypy#4266.)
    __hash__ = None  # type: ignore[assignment]

    @property
    def task(self) -> str:
        return str(self.metadata.get("task", "math"))

    def to_dict(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "answer": self.answer, "metadata": dict(self.metadata)}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> Record:
        return cls(
            prompt=row["prompt"], answer=row["answer"], metadata=dict(row.get("metadata") or {})
        )
