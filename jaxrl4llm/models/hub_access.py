"""Reaching the Hugging Face Hub, or failing fast without it: shared by `hf:` data sources
(jaxrl4llm.data.hub) and hub model names (jaxrl4llm.models.registry).

Offline is the normal case on clusters. huggingface_hub retries an unreachable host with
backoff (five retries per request, ~25 s and a warning line each), so before its first
request a run probes the endpoint (HF_ENDPOINT, or the proxy that reaches it) with one TCP
connection of at most PROBE_TIMEOUT_S. When that fails, the caller raises one error naming
the repository, the hub cache and the fix: `hf download ...` where there is network, or
`HF_HUB_OFFLINE=1` when the cache already holds the revision.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import urllib.parse
import urllib.request

PROBE_TIMEOUT_S = 3.0
_TRUE = ("1", "ON", "YES", "TRUE")


def settings() -> tuple[str, bool]:
    """(cache folder, offline), read from the environment now (huggingface_hub reads them
    once at import): HF_HUB_CACHE / HF_HOME and HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE."""
    from huggingface_hub import constants

    cache = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub")
        if os.environ.get("HF_HOME")
        else constants.HF_HUB_CACHE
    )
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    offline = flag.strip().upper() in _TRUE or constants.HF_HUB_OFFLINE
    return os.path.expanduser(cache), offline


def endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _first_hop(url: str) -> tuple[str, int]:
    """(host, port) of the first TCP connection a request to `url` makes: its proxy, if the
    environment names one for it, else the host itself."""
    parts = urllib.parse.urlsplit(url)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(parts.hostname or ""):
        parts = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


@functools.cache
def reachable(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to `url`'s host (or its proxy) opens within `timeout_s`,
    name resolution included (in a thread: a resolver without a server can block longer)."""
    host, port = _first_hop(url)
    opened: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            opened.append(True)
        except OSError:
            opened.append(False)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout_s)
    return bool(opened and opened[0])


def _folder(cache: str, repo: str, repo_type: str) -> str:
    return os.path.join(cache, f"{repo_type}s--" + repo.replace("/", "--"))


def cached_snapshot(cache: str, repo: str, repo_type: str, revision: str) -> str | None:
    """The cache's snapshot folder of `repo` at `revision` (a branch, tag or commit), or None
    when the cache does not hold it."""
    folder = _folder(cache, repo, repo_type)
    commit = revision
    ref = os.path.join(folder, "refs", revision)
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    snapshot = os.path.join(folder, "snapshots", commit)
    return snapshot if os.path.isdir(snapshot) else None


def download_command(repo: str, repo_type: str, revision: str, cache: str) -> str:
    """The `hf` command (huggingface_hub's CLI) that puts `repo` at `revision` in `cache`."""
    kind = "" if repo_type == "model" else f" --repo-type {repo_type}"
    pin = "" if revision == "main" else f" --revision {revision}"
    return f"hf download {repo}{kind}{pin} --cache-dir {cache}"


def fix_hint(repo: str, repo_type: str, revision: str, cache: str) -> str:
    """How to get `repo` without network: read the cache, or fill it where there is network."""
    if cached_snapshot(cache, repo, repo_type, revision):
        return (
            f"the hub cache {cache} holds {repo}@{revision}: set HF_HUB_OFFLINE=1 to read "
            "it from there"
        )
    return (
        f"{repo}@{revision} is not in the hub cache {cache}: run `"
        f"{download_command(repo, repo_type, revision, cache)}` where there is network "
        "(on a cluster: a login node, or copy the folder over), then set HF_HUB_OFFLINE=1"
    )


def require_reachable(repo: str, repo_type: str, revision: str, cache: str) -> str | None:
    """None when the hub answers; else the message of the error the caller raises."""
    url = endpoint()
    if reachable(url):
        return None
    return (
        f"cannot reach the Hugging Face Hub ({url}: no network?) to fetch {repo}; "
        f"{fix_hint(repo, repo_type, revision, cache)}"
    )
