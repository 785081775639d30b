"""Atomic file output: write beside the target under a temporary name, rename on success."""
from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator


def make_ordinary_permissions(path: str | os.PathLike) -> None:
    """Gives a written file the permissions of a normally created one (0666 minus the umask).

    MindSpore's `save_checkpoint` leaves its files read-only (0400), which breaks overwriting and sharing.
    """
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str = "") -> Iterator[str]:
    """Yields a temporary path in `path`'s folder; it replaces `path` when the block succeeds.

    On any error the temporary file, and anything a writer left under the same stem (MindSpore's
    `save_checkpoint` writes `<stem>.tmp` first), are removed, and an existing `path` is untouched.
    `suffix` keeps the extension that some writers require (e.g. `.ckpt`). The file gets ordinary
    permissions (`make_ordinary_permissions`).
    """
    path = os.path.abspath(os.fspath(path))
    directory, base = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    stem = os.path.join(directory, f".{base}.{os.getpid()}.partial")
    tmp = stem + suffix
    try:
        yield tmp
        make_ordinary_permissions(tmp)
        os.replace(tmp, path)
    except BaseException:
        for leftover in glob.glob(glob.escape(stem) + "*"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)
        raise
