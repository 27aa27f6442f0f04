"""Hugging Face Hub dataset repositories as prompt sources: `hf:OWNER/NAME[:CONFIG][@SPLIT]`.

Files come through `huggingface_hub` (installed with transformers): its cache
(`HF_HUB_CACHE`, default ~/.cache/huggingface/hub), revision pinning (a branch, tag or
commit) and offline mode (`HF_HUB_OFFLINE=1`: only the cache is read, and a file that is not
cached is an error naming the repository and the file). Without network (the normal case on
a cluster's compute nodes) the first request fails within seconds, naming the cache and the
`hf download` command (jaxrl4llm.models.hub_access). Which files hold a config's split
follows the Hub's conventions: the `configs:` block of the repository's README.md when it
has one, else the split name in the file path (`test.jsonl`, `data/test-0000.parquet`,
`main/test-*.parquet` for config `main`). Parquet, JSONL and JSON files are read with pyarrow
and the json module into the same (location, row) stream as local files. No `datasets`
package: see docs/data.md for why.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
from typing import Any, Iterator

from jaxrl4llm.data.records import DataError
from jaxrl4llm.data.rows import jsonl_rows, parquet_rows
from jaxrl4llm.models import hub_access

DATA_EXTENSIONS = (".parquet", ".jsonl", ".json")
# Split names as the Hub's file-name conventions spell them.
SPLIT_WORDS = {
    "train": ("train", "training"),
    "test": ("test", "testing", "eval", "evaluation"),
    "validation": ("validation", "valid", "val", "dev"),
}
_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


@dataclasses.dataclass(frozen=True)
class HubSpec:
    repo: str  # OWNER/NAME
    config: str | None = None  # a `configs:` name (subset), e.g. "main" for openai/gsm8k
    split: str | None = None  # the Hub split; None: the run's split ("train" / "test")

    @classmethod
    def parse(cls, body: str) -> HubSpec:
        """'OWNER/NAME[:CONFIG][@SPLIT]' (the text after 'hf:')."""
        rest, _, split = body.partition("@")
        repo, _, config = rest.partition(":")
        if not _REPO_RE.match(repo):
            raise DataError(
                f"hf:{body}: expected hf:OWNER/NAME[:CONFIG][@SPLIT], e.g. "
                "hf:openai/gsm8k:main@test"
            )
        return cls(repo, config or None, split or None)

    def __str__(self) -> str:
        return (
            f"hf:{self.repo}"
            + (f":{self.config}" if self.config else "")
            + (f"@{self.split}" if self.split else "")
        )


hub_settings = hub_access.settings


class HubRepo:
    """One dataset repository at one revision: lists, resolves and downloads its files."""

    def __init__(self, repo: str, revision: str | None = None):
        self.repo, self.revision = repo, revision or "main"
        self.cache, self.offline = hub_settings()
        self.commit: str | None = self.revision if _COMMIT_RE.match(self.revision) else None

    def _hint(self) -> str:
        if self.offline:
            command = hub_access.download_command(self.repo, "dataset", self.revision, self.cache)
            return (
                f"HF_HUB_OFFLINE is set and the file is not in the hub cache {self.cache}; "
                f"download it where there is network (`{command}`) or unset HF_HUB_OFFLINE"
            )
        return "check the repository name, revision and your network / HF_TOKEN"

    def _check_network(self) -> None:
        """Fails fast, with the offline fix, when the hub cannot be reached (see
        jaxrl4llm.models.hub_access); a no-op in offline mode."""
        if self.offline:
            return
        problem = hub_access.require_reachable(self.repo, "dataset", self.revision, self.cache)
        if problem:
            raise DataError(f"hf:{self.repo}: {problem}")

    def download(self, path: str) -> str:
        """The local path of `path` at this revision (from the cache, or downloaded into it).
        The first download pins the commit, so every later file comes from the same one."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            OfflineModeIsEnabled,
        )

        self._check_network()
        try:
            local = hf_hub_download(
                self.repo,
                path,
                repo_type="dataset",
                revision=self.commit or self.revision,
                cache_dir=self.cache,
                local_files_only=self.offline,
            )
        except LocalEntryNotFoundError:
            raise DataError(
                f"hf:{self.repo}: file {path!r} (revision {self.revision}) is not "
                f"available: {self._hint()}"
            ) from None
        except EntryNotFoundError:
            raise DataError(
                f"hf:{self.repo}: the repository has no file {path!r} at revision {self.revision}"
            ) from None
        except (HfHubHTTPError, OfflineModeIsEnabled, OSError) as exc:
            raise DataError(
                f"hf:{self.repo}: cannot fetch {path!r} at revision "
                f"{self.revision} ({type(exc).__name__}: {exc}); {self._hint()}"
            ) from None
        if self.commit is None:
            self.commit = _commit_of(local)
        return local

    def readme_metadata(self) -> dict[str, Any]:
        """The YAML header of README.md ({} when the repository has no README)."""
        from huggingface_hub.repocard import metadata_load

        try:
            return metadata_load(self.download("README.md")) or {}
        except DataError as exc:
            # Offline, a README that is not cached leaves the file names to decide.
            if "has no file" in str(exc) or self.offline:
                return {}
            raise

    def files(self) -> list[str]:
        """Every file path of the repository at this revision (offline: those cached)."""
        if self.offline:
            folder = self._snapshot_folder()
            return sorted(
                os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
                for root, _, names in os.walk(folder)
                for name in names
            )
        from huggingface_hub import HfApi

        self._check_network()
        try:
            return sorted(
                HfApi().list_repo_files(
                    self.repo, repo_type="dataset", revision=self.commit or self.revision
                )
            )
        except Exception as exc:  # noqa: BLE001 - httpx / hub errors of many types
            raise DataError(
                f"hf:{self.repo}: cannot list the repository's files at revision "
                f"{self.revision} ({type(exc).__name__}: {exc}); {self._hint()}"
            ) from None

    def _snapshot_folder(self) -> str:
        root = os.path.join(self.cache, "datasets--" + self.repo.replace("/", "--"))
        if self.commit is None:
            ref = os.path.join(root, "refs", self.revision)
            if not os.path.exists(ref):
                raise DataError(
                    f"hf:{self.repo}: revision {self.revision!r} is not in the hub "
                    f"cache ({ref} is missing): {self._hint()}"
                )
            with open(ref) as f:
                self.commit = f.read().strip()
        return os.path.join(root, "snapshots", self.commit)


def _commit_of(local_path: str) -> str | None:
    parts = os.path.normpath(local_path).split(os.sep)
    if "snapshots" in parts:
        i = len(parts) - 1 - parts[::-1].index("snapshots")
        if i + 1 < len(parts):
            return parts[i + 1]
    return None


def _split_patterns(
    metadata: dict[str, Any], config: str | None, split: str, where: str
) -> list[str] | None:
    """Path patterns of (config, split) from README `configs:`; None when it has none."""
    configs = metadata.get("configs")
    if not isinstance(configs, list) or not configs:
        return None
    names = [c.get("config_name", "default") for c in configs]
    if config is None:
        chosen = [c for c in configs if c.get("default")] or (configs if len(configs) == 1 else [])
        if not chosen:
            raise DataError(
                f"{where}: the repository has configs {', '.join(names)}; name one, "
                f"e.g. {where}:{names[0]}"
            )
        entry = chosen[0]
    elif config in names:
        entry = configs[names.index(config)]
    else:
        raise DataError(f"{where}: no config {config!r}; the repository has {', '.join(names)}")
    files = entry.get("data_files")
    if isinstance(files, dict):  # {split: path(s)}
        files = [{"split": k, "path": v} for k, v in files.items()]
    elif isinstance(files, (str, list)) and (
        isinstance(files, str) or all(isinstance(f, str) for f in files)
    ):
        files = [{"split": "train", "path": files}]  # paths without a split: train
    by_split = {f.get("split", "train"): f.get("path") for f in files or []}
    if split not in by_split:
        raise DataError(
            f"{where}: config {entry.get('config_name', 'default')!r} has no split "
            f"{split!r}; it has {', '.join(by_split) or 'none'}"
        )
    paths = by_split[split]
    return [paths] if isinstance(paths, str) else list(paths)


def _split_matches(path: str, split: str) -> bool:
    words = SPLIT_WORDS.get(split, (split,))
    parts = re.split(r"[/_.\-]", path.lower())
    return any(word in parts for word in words)


def resolve_files(repo: HubRepo, spec: HubSpec, split: str) -> list[str]:
    """The repository paths that hold `spec`'s config and `split`, in order."""
    where = f"hf:{spec.repo}" + (f":{spec.config}" if spec.config else "")
    patterns = _split_patterns(repo.readme_metadata(), spec.config, split, where)
    if patterns is not None:
        found, missing = [], []
        listing = None
        for pattern in patterns:
            if not any(ch in pattern for ch in "*?["):
                found.append(pattern)  # a plain path: downloaded (or reported missing) as is
                continue
            listing = repo.files() if listing is None else listing
            matched = [p for p in listing if fnmatch.fnmatch(p, pattern)]
            (found.extend(matched) if matched else missing.append(pattern))
        if missing:
            state = "in the hub cache" if repo.offline else "in the repository"
            raise DataError(
                f"{where}@{split}: no file {state} matches {', '.join(missing)} "
                f"(revision {repo.revision}); {repo._hint()}"
            )
        return found
    data = [p for p in repo.files() if p.endswith(DATA_EXTENSIONS)]
    if spec.config:
        data = [p for p in data if p.split("/")[0] == spec.config]
    matched = [p for p in data if _split_matches(p, split)]
    if (
        not matched
        and split == "train"
        and not any(_split_matches(p, s) for p in data for s in SPLIT_WORDS)
    ):
        matched = data  # the Hub's rule: files without a split name are the train split
    if not matched:
        where_files = "cached" if repo.offline else "in the repository"
        raise DataError(
            f"{where}: no data file for split {split!r} among the files "
            f"{where_files} ({', '.join(data[:8]) or 'none'}); name the split "
            f"(hf:{spec.repo}@SPLIT) or the config; {repo._hint()}"
        )
    return matched


def _json_rows(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    if path.endswith(".json") and head.startswith(b"["):
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
        yield from ((f"{path}:row {i}", row) for i, row in enumerate(rows, 1))
    else:
        yield from jsonl_rows(path)


def hub_rows(
    spec: HubSpec, split: str, revision: str | None = None
) -> tuple[Iterator[tuple[str, Any]], HubRepo]:
    """(location, row) pairs of one config / split of a Hub dataset, and its HubRepo (whose
    `commit` says exactly which version was read, once rows are consumed)."""
    repo = HubRepo(spec.repo, revision)
    paths = resolve_files(repo, spec, spec.split or split)
    local_paths = [(p, repo.download(p)) for p in paths]  # fail early, before any row

    def rows():
        for path, local in local_paths:
            where = f"hf:{spec.repo}@{repo.commit or repo.revision}/{path}"
            if path.endswith(".parquet"):
                yield from parquet_rows(local, where)
            else:
                for loc, row in _json_rows(local):
                    yield where + loc[len(local) :], row

    return rows(), repo
