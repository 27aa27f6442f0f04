"""A thin wrapper over a transformers tokenizer: chat prompts, encode/decode, stop ids, padding.

Pad ids only fill space: SmolLM2's pad token *is* its end-of-turn token, so which slots hold
real tokens always comes from the lengths (`left_pad` returns the mask and positions), never
from comparing ids with `pad_token_id`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import numpy as np

# End-of-turn / end-of-text tokens of the supported families; those in the vocab stop sampling.
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")

Messages = Sequence[dict[str, str]]


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """Wraps a `transformers` tokenizer; `stop_token_ids` end a completion."""

    hf_tokenizer: Any
    stop_token_ids: tuple[int, ...]
    pad_token_id: int
    bos_token_id: int | None

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        gguf_file: str | None = None,
        extra_stop_ids: Sequence[int] = (),
    ) -> "Tokenizer":
        """Loads from a HF folder, or from `gguf_file` (a file name inside folder `path`)."""
        path = os.fspath(path)
        try:
            if gguf_file:
                hf = _hf_tokenizer_from_gguf(os.path.join(path, gguf_file))
            else:
                from transformers import AutoTokenizer  # heavy import, only when needed

                hf = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(
                f"Could not load a tokenizer from {path!r}"
                f"{f' (gguf_file={gguf_file!r})' if gguf_file else ''}: {e}"
            ) from e
        return cls.from_hf(hf, extra_stop_ids)

    @classmethod
    def from_hf(cls, hf: Any, extra_stop_ids: Sequence[int] = ()) -> "Tokenizer":
        vocab = hf.get_vocab()
        stops = [hf.eos_token_id] if hf.eos_token_id is not None else []
        stops += [vocab[t] for t in _STOP_TOKENS if t in vocab]
        stops += list(extra_stop_ids)
        stop_ids = tuple(dict.fromkeys(int(s) for s in stops))  # ordered, unique
        if not stop_ids:
            raise ValueError(
                f"The tokenizer has no eos token and none of {_STOP_TOKENS}; pass extra_stop_ids."
            )
        pad = hf.pad_token_id if hf.pad_token_id is not None else stop_ids[0]
        return cls(
            hf_tokenizer=hf,
            stop_token_ids=stop_ids,
            pad_token_id=int(pad),
            bos_token_id=hf.bos_token_id,
        )

    @property
    def eos_token_id(self) -> int:
        return self.stop_token_ids[0]

    @property
    def vocab_size(self) -> int:
        return len(self.hf_tokenizer)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(
            [int(i) for i in ids], skip_special_tokens=skip_special_tokens
        )

    def apply_chat_template(
        self,
        messages: Messages | str,
        system: str | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text for `messages` (a str is one user turn); ends ready for the reply."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        messages = list(messages)
        if system is not None:
            messages = [{"role": "system", "content": system}] + messages
        if not getattr(self.hf_tokenizer, "chat_template", None):
            raise ValueError(
                "This tokenizer has no chat template; format prompts yourself and "
                "call encode(), or load an instruct model's tokenizer."
            )
        return self.hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_chat(self, messages: Messages | str, system: str | None = None) -> list[int]:
        """Token ids of the chat prompt (special tokens come from the template itself)."""
        return self.encode(self.apply_chat_template(messages, system))


# Metadata string arrays read in full (as transformers' GGUF reader does); other string
# arrays are passed on as their length.
_GGUF_FULL_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


def _hf_tokenizer_from_gguf(gguf_path: str) -> Any:
    """The transformers tokenizer a GGUF file describes (vocabulary, merges, special tokens,
    chat template), built from its metadata with transformers' own GGUF converters.

    transformers' GGUF *file reader* imports torch, which a plain `pip install` of this project
    does not bring (and which costs ~0.2 GiB of RSS where it is installed), so the metadata is
    read with the `gguf` package and handed to the same conversion `AutoTokenizer` uses.
    """
    import gguf
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    if not os.path.isfile(gguf_path):
        raise OSError(f"GGUF file {gguf_path!r} does not exist.")
    reader = gguf.GGUFReader(gguf_path)

    def value(key: str) -> Any:
        contents = reader.fields[key].contents()
        if (
            isinstance(contents, list)
            and contents
            and isinstance(contents[0], str)
            and key not in _GGUF_FULL_STRING_ARRAYS
        ):
            return len(contents)
        return contents

    metadata = {
        k: value(k)
        for k in reader.fields
        if k.startswith("tokenizer.") or k == "general.architecture"
    }
    grouped = {
        group: {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }
        for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)  # llama.cpp's default, as transformers
    for name, key in mapping._SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = (
            tokenizer_dict["tokens"][token_id] if token_id is not None else None
        )
    backend, extra = mapping.convert_gguf_tokenizer(
        metadata["general.architecture"], tokenizer_dict
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, length: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Left-pads id lists -> (tokens_BT int32, mask_BT bool, positions_BT int32).

    positions = cumsum(mask) - 1 clipped at 0, so every row's first real token sits at 0.
    """
    longest = max((len(s) for s in sequences), default=0)
    length = longest if length is None else length
    if longest > length:
        raise ValueError(
            f"A prompt has {longest} tokens, more than the length {length} to pad "
            "to; raise the maximum prompt length or shorten the prompt."
        )
    tokens_BT = np.full((len(sequences), length), pad_id, np.int32)
    mask_BT = np.zeros((len(sequences), length), bool)
    for b, seq in enumerate(sequences):
        if len(seq):
            tokens_BT[b, length - len(seq) :] = seq
            mask_BT[b, length - len(seq) :] = True
    positions_BT = np.maximum(np.cumsum(mask_BT, axis=1) - 1, 0).astype(np.int32)
    return tokens_BT, mask_BT, positions_BT
