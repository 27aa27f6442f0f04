"""Workdir paths: a local folder or an object store (`gs://bucket/run`, and the other schemes
fsspec reaches: s3://, az://), one set of functions for every file a run
writes or reads (config.json, metrics.jsonl, the trackers' ids and events, eval results,
plots, the study root, the workdir lock, checkpoint records; orbax writes the checkpoints
themselves through tensorstore, which takes the same URLs).

Local paths keep the operating system's semantics (absolute paths, atomic replace, append);
an object store has no folders and no append, so `append_text` rewrites the object and
`makedirs` does nothing there. The object-store client (gcsfs for gs://) is the optional
`gcs` extra, imported only when a remote path is used.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_remote(path: str) -> bool:
    """Whether `path` is an object-store URL (a scheme other than file://)."""
    return bool(_SCHEME.match(str(path))) and not str(path).startswith("file://")


def absolute(path: str) -> str:
    """A local path made absolute; a URL as it is (os.path.abspath would turn gs://b/r into
    $CWD/gs:/b/r)."""
    path = str(path)
    if path.startswith("file://"):
        path = path[len("file://") :]
    return path.rstrip("/") if is_remote(path) else os.path.abspath(path)


def join(path: str, *parts: str) -> str:
    if is_remote(path):
        return "/".join([str(path).rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(path, *parts)


def basename(path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1] if is_remote(path) else os.path.basename(path)


def _fs(path: str) -> tuple[Any, str]:
    """(the fsspec filesystem, the key) of an object-store URL: one cached client per scheme
    and options, so a write is seen by the next listing."""
    import fsspec

    fs, key = fsspec.core.url_to_fs(path)
    return fs, key


def _ask(path: str, question: str) -> bool:
    """fs.exists / isdir / isfile of an object-store URL, past the client's listing cache
    (another host, or orbax's own client, may have written since)."""
    fs, key = _fs(path)
    fs.invalidate_cache()
    return bool(getattr(fs, question)(key))


def exists(path: str) -> bool:
    return _ask(path, "exists") if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    """A folder (local), or a prefix holding at least one object (object store)."""
    return _ask(path, "isdir") if is_remote(path) else os.path.isdir(path)


def isfile(path: str) -> bool:
    return _ask(path, "isfile") if is_remote(path) else os.path.isfile(path)


def listdir(path: str) -> list[str]:
    """The names directly under `path` ([] where there is nothing)."""
    if not is_remote(path):
        return os.listdir(path) if os.path.isdir(path) else []
    if not isdir(path):
        return []
    fs, key = _fs(path)
    return [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(key, detail=False)]


def makedirs(path: str) -> None:
    """Creates a local folder and its parents; an object store needs none."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def read_text(path: str) -> str:
    if is_remote(path):
        return read_bytes(path).decode("utf-8", errors="replace")
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def read_bytes(path: str) -> bytes:
    if is_remote(path):
        fs, key = _fs(path)
        return bytes(fs.cat_file(key))
    with open(path, "rb") as f:
        return f.read()


def write_bytes(path: str, data: bytes) -> None:
    """Writes `path` whole: locally aside then renamed (atomic), on an object store one
    upload (an object appears whole or not at all)."""
    if is_remote(path):
        fs, key = _fs(path)
        fs.pipe_file(key, data)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def append_text(path: str, text: str) -> None:
    """Appends `text` (an object store has no append: the object is read and written again,
    which for a run's metrics file costs little beside a training step)."""
    if is_remote(path):
        old = read_bytes(path) if exists(path) else b""
        write_bytes(path, old + text.encode("utf-8"))
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def create_exclusive(path: str, text: str) -> bool:
    """Writes `path` only if it does not exist; False if it did (the workdir lock's test and
    set: O_EXCL locally, an upload conditioned on no live generation on GCS)."""
    if not is_remote(path):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True
    if exists(path):  # the precondition below decides races; this, stores that ignore it
        return False
    fs, key = _fs(path)
    try:
        fs.pipe_file(key, text.encode("utf-8"), mode="create")
    except (FileExistsError, OSError) as exc:
        if isinstance(exc, FileExistsError) or "412" in str(exc) or "recondition" in str(exc):
            return False
        raise
    return True


def remove(path: str) -> None:
    """Deletes a file or a whole folder / prefix; nothing where there is nothing."""
    if is_remote(path):
        if exists(path):
            fs, key = _fs(path)
            fs.rm(key, recursive=True)
        return
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def rename(src: str, dst: str) -> None:
    """Moves a file or folder (on an object store: every object under the prefix, copied
    then deleted)."""
    if not is_remote(src):
        os.rename(src, dst)
        return
    fs, key = _fs(src)
    target = _fs(dst)[1]
    fs.invalidate_cache()
    try:
        fs.mv(key, target, recursive=True)  # server-side copies, then deletes
    except OSError:
        # A store without server-side copy (an emulator): through the client.
        for name in fs.find(key):
            fs.pipe_file(target + name[len(key) :], fs.cat_file(name))
        fs.rm(key, recursive=True)
    fs.invalidate_cache()


def size_bytes(path: str) -> int:
    """Bytes of the objects under an object-store prefix (0 where there are none)."""
    if not exists(path):
        return 0
    fs, key = _fs(path)
    return int(fs.du(key, total=True))


def free_gib(path: str) -> float | None:
    """Free space where `path` is, in GiB; None on an object store (no such figure)."""
    if is_remote(path):
        return None
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return shutil.disk_usage(probe).free / 2**30
