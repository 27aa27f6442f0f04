"""docs/library.md runs as written: its Python blocks, in order, train the toy task with
GRPO and with a registered loss and estimator, and run a clip schedule in one compilation."""

from __future__ import annotations

import os
import re

from jaxrl4llm.rl import registry

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "library.md")


def test_the_library_page_trains_the_toy_task(capsys):
    with open(DOC, encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) == 3
    namespace: dict = {}
    try:
        for block in blocks:
            exec(compile(block, DOC, "exec"), namespace)
    finally:
        registry._POLICY_LOSSES.pop("reinforce_with_baseline_clip", None)
        registry._ADVANTAGES.pop("centred_verdicts", None)
    rewards = namespace["rewards"]
    assert sum(rewards[:5]) / 5 < 0.3 and sum(rewards[-5:]) / 5 > 0.9  # 1/7 -> solved
    assert float(namespace["reward"]) > 0.9  # the registered loss and estimator learn too
    printed = capsys.readouterr().out.splitlines()
    schedule = [float(line) for line in printed if re.fullmatch(r"-?[0-9.]+", line)]
    assert len(set(schedule)) == 4  # the four clip_high values give four losses
    assert namespace["loss_at"]._cache_size() == 1  # and one compiled program
