"""Atomic file output: write beside the target under a temporary name, rename on success."""
from __future__ import annotations

import contextlib
import glob
import os
from typing import Iterator


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = "") -> Iterator[str]:
    """Yields a temporary path in `path`'s folder; it replaces `path` when the block succeeds.

    On any error the temporary file, and anything a writer left under the same stem (MindSpore's
    `save_checkpoint` writes `<stem>.tmp` first), are removed, and an existing `path` is untouched.
    `suffix` keeps the extension that some writers require (e.g. `.ckpt`).
    """
    path = os.path.abspath(os.fspath(path))
    directory, base = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    stem = os.path.join(directory, f".{base}.{os.getpid()}.partial")
    tmp = stem + suffix
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        for leftover in glob.glob(glob.escape(stem) + "*"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)
        raise
