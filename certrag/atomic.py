"""The one way certrag writes a file or publishes a folder so that a reader, or a process killed half-way, never
sees half of it: the new content goes to a temporary name beside the target, is flushed to disk (fsync), then
renamed over the target, and the folder's entry is flushed too."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """data into path (a new file), flushed to disk before returning."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_file_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Replaces path with data so that a reader sees either the old file or the whole new one, even after a kill.
    The temporary file is `.NAME.tmp-PID-THREAD` beside it (removed on failure; a killed write's is left for its
    owner's cleanup: certrag.store removes a store's on its next write)."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def publish_folder(staging: str | os.PathLike, target: str | os.PathLike, *, replace: bool = False) -> Path:
    """Moves a finished folder (staging, on the same file system) to target in one rename. When target exists:
    replace=True swaps it out (the old one is renamed aside, then removed); replace=False keeps it and drops staging
    -- for caches, where another process that got there first made the same content."""
    staging, target = Path(staging), Path(target)
    if target.exists() and not replace:
        shutil.rmtree(staging, ignore_errors=True)
        return target
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}-{threading.get_ident()}")
        target.rename(old)
    try:
        staging.rename(target)
    except OSError:
        if old is not None and not target.exists():
            old.rename(target)  # put the old one back
        if target.exists() and not replace:
            shutil.rmtree(staging, ignore_errors=True)
            return target
        raise
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target
