"""Where an exception was raised, as a user reads it: one `file:line`, not a traceback."""
from __future__ import annotations

import site
import sys
import traceback


def where_raised(err: BaseException) -> str:
    """'file:line' where `err` was raised in the user's own code: the innermost frame of its traceback outside
    Python's own and installed libraries (the innermost of all when every frame is there), or ''."""
    frames = traceback.extract_tb(err.__traceback__)
    libraries = tuple({sys.prefix, sys.base_prefix, *site.getsitepackages()})
    own = [frame for frame in frames if not frame.filename.startswith(("<", *libraries))]
    frame = (own or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame else ""
