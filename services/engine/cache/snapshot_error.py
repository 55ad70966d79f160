"""The one error a snapshot file raises: a file that must not be adopted (or a path that must
not be followed), with a short machine `reason` (snapshot_file.py lists them)."""

from __future__ import annotations


class SnapshotFileError(Exception):
    """A snapshot file that must not be adopted; `reason` is a short machine word."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
