"""The user-facing error (one line naming the file, the record and the fix) and the log line."""
from __future__ import annotations

import sys


class DraftsmithError(Exception):
    """A user-facing error: one line naming the file, the record and the fix.

    The CLI prints it as `error: <message>` and exits with status 2, without a traceback.
    """


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
