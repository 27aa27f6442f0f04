import dataclasses

from jaxrl4llm.envs import Environment, StepResult, answer_reward, register


@dataclasses.dataclass(frozen=True)
class CounterOptions:
    max_calls: int = 3  # --env=letters?max_calls=5 sets it


class LetterCounter(Environment):
    """A tool that counts characters: <count>strawberry</count> -> 10."""

    Options = CounterOptions
    stop_strings = ("</count>",)  # a model turn that writes this ends: the tool is called
    observation_role = "tool"  # the tool's output comes back as a tool turn

    def reset(self, record):
        self.record, self.calls = record, 0
        return None  # None: the prompt is the record's

    def step(self, turn_text):
        text = turn_text.rstrip()
        if not text.endswith("</count>"):  # no call: this turn is the final answer
            return StepResult(reward=answer_reward(text, self.record, self.reward), done=True)
        self.calls += 1
        if self.calls > self.options.max_calls:
            return StepResult("no calls left", tool_call=True, status="error")
        word = text[: -len("</count>")].rsplit("<count>", 1)[-1]
        return StepResult(str(len(word.strip())), tool_call=True)


register("letters", LetterCounter)
