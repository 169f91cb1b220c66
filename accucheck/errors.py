"""The one user-error type. Imports nothing from accucheck.

A `UserError` is bad input (a missing file, an incomplete capture, a wrong flag combination):
the CLI prints its message as one line and exits with `exit_code`. Every other exception is a
bug and keeps its traceback.
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_DIVERGENCE = 1
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3


class UserError(Exception):
    """Bad input: one line that says what happened and what to do next."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        if "\n" in message:
            raise ValueError("UserError messages are one line")
        super().__init__(message)
        self.exit_code = exit_code
