"""Stop strings as token ids and the observation template, with the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from jaxrl4llm.config.errors import FlagError
from jaxrl4llm.envs.handler import ObservationTemplate, stop_token_sequences


@pytest.mark.parametrize(
    "stop, written",
    [
        ("</calc>", ["12*34</calc>", "Let me compute <calc>12 * 34 </calc>", "x)</calc>"]),
        ("```output", ["```python\nprint(1)\n```\n```output", "code: ```output"]),
        ("</guess>", ["<guess>50</guess>", "<guess> 50 </guess>"]),
    ],
)
def test_what_the_model_writes_ends_with_a_stop_sequence(smollm2_tokenizer, stop, written):
    tok = smollm2_tokenizer
    sequences = stop_token_sequences(tok, [stop])
    assert all(tok.decode(s, skip_special_tokens=False).endswith(stop) for s in sequences)
    for text in written:
        ids = tuple(tok.encode(text))
        assert any(ids[-len(s) :] == s for s in sequences), (text, ids, sequences)
    # The stop string's own tokens, and after a space (" </" is one token in SmolLM2's BPE).
    assert tuple(tok.encode(stop)) in sequences
    assert len(set(sequences)) == len(sequences)
    # Text that stops short of the marker does not end with any.
    short = tuple(tok.encode(written[0][:-1]))
    assert not any(short[-len(s) :] == s for s in sequences)


def test_observation_template_roles_and_the_inline_form(smollm2_tokenizer):
    tok = smollm2_tokenizer
    tool = ObservationTemplate(tok, "tool", max_tokens=32)
    assert tok.decode(tool.ids("408"), skip_special_tokens=False) == (
        "<|im_end|>\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    )
    inline = ObservationTemplate(tok, None, max_tokens=32)
    assert inline.ids("\n42\n```\n") == tuple(tok.encode("\n42\n```\n"))


def test_a_long_observation_is_cut_to_the_budget_with_the_template_whole(smollm2_tokenizer):
    tok = smollm2_tokenizer
    template = ObservationTemplate(tok, "user", max_tokens=24)
    ids = template.ids(" ".join(str(i) for i in range(500)))
    text = tok.decode(ids, skip_special_tokens=False)
    assert len(ids) == 24
    assert text.startswith("<|im_end|>\n<|im_start|>user\n0 1 2")
    assert text.endswith("\n[... cut]<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(FlagError, match="--max_observation_tokens=8 leaves no room"):
        ObservationTemplate(tok, "user", max_tokens=8)
