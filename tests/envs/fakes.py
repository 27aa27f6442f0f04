"""Environments for the handler's tests, importable by the pool's workers (the environment
travels pickled, by reference to its class): well-behaved, slow, crashing and hostile."""

from __future__ import annotations

import os
import threading
import time

from jaxrl4llm.envs.base import Environment, StepResult


class Echo(Environment):
    """Answers each turn with "you said: TEXT"; the third turn ends the game (reward 1)."""

    stop_strings = ("</say>",)

    def reset(self, record):
        self.turns = 0
        return None

    def step(self, turn_text):
        self.turns += 1
        return StepResult(f"you said: {turn_text}", 0.5 * (self.turns == 3), self.turns == 3)


class Sleepy(Echo):
    """Takes two seconds per step, then answers as Echo."""

    def step(self, turn_text):
        time.sleep(2.0)
        return super().step(turn_text)


class Hostile(Environment):
    """Misbehaves as its turn text says."""

    def reset(self, record):
        return None

    def step(self, turn_text):
        if turn_text == "loop":
            while True:
                pass
        if turn_text == "exit":
            os._exit(7)
        if turn_text == "raise":
            raise RuntimeError("boom")
        if turn_text == "huge":
            return StepResult("x" * 50_000_000)
        if turn_text == "binary":
            return StepResult(b"\xff\xfeok\x00\x01")
        if turn_text == "surrogates":
            return StepResult(b"caf\xe9 ok".decode("utf-8", errors="surrogateescape"))
        if turn_text == "nan":
            return StepResult("fine", float("nan"))
        if turn_text == "not-a-result":
            return "just text"
        return StepResult("fine", 1.0)


class Unpicklable(Echo):
    """Holds a lock: cannot travel to a worker."""

    def reset(self, record):
        self.lock = threading.Lock()
        return None


class Introduces(Echo):
    """Its reset gives the first user turn."""

    def reset(self, record):
        super().reset(record)
        return f"Let us talk about {record['prompt']}."


class BrokenReset(Echo):
    def reset(self, record):
        raise ValueError("no such game")
