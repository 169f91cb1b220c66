"""The one user-error type and the exit codes. Imports nothing from accucheck.

A `UserError` is bad input: the CLI prints its message as one line ("accucheck: error: ...")
and exits with `exit_code`. Every other exception is a bug and keeps its traceback.

Exit codes, the same for every command:

0  within tolerance / done
1  divergence found (diff, signoff, replay)
2  usage error: the command line itself is wrong, whatever the files hold (an unknown --dtype,
   --mode or --device, a flag combination that cannot work, no prompts given, a value out of
   range, an input named as the output): `UserError.usage(...)`, and every click error
3  bad input: what the files or this machine hold does not allow the command (a missing,
   unreadable, damaged, incomplete or incompatible capture or model, an output that exists
   without --force, a full disk, a device that is not there, an interrupted capture)
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

    @classmethod
    def usage(cls, message: str) -> "UserError":
        """A usage error (exit 2): the command line is wrong whatever the files hold."""
        return cls(message, EXIT_USAGE)


def one_line(text: object, limit: int = 300) -> str:
    """`text` (an exception, a message) as one line of at most `limit` characters: every line
    kept, whitespace collapsed, never cut mid-word without an ellipsis."""
    s = " ".join(str(text).split())
    if len(s) <= limit:
        return s
    cut = s[:limit].rsplit(" ", 1)[0]
    return cut + " …"
