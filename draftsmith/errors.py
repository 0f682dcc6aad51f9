"""User errors and the one way every command reports them.

A `UserError` is a mistake in what the user asked for (a bad value, a missing file, an output that
would be overwritten): every command entry point runs under `run_main`, which prints it as one line
`error: <message>` on stderr and exits with status 2, without a traceback. `--debug` on the command
line or `DRAFTSMITH_DEBUG=1` in the environment shows the traceback instead. Anything that is not a
`UserError` is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

DEBUG_ENV = "DRAFTSMITH_DEBUG"
DEBUG_FLAG = "--debug"
USAGE_EXIT = 2


class UserError(ValueError):
    """A bad request by the user; the message names the bad value and what is valid."""


def debug_requested(argv: Sequence[str]) -> bool:
    return DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def run_main(main: Callable[[list[str]], object], argv: Sequence[str] | None = None) -> int:
    """Call `main(argv)`; a UserError (or a FileNotFoundError naming a path) becomes one line and exit 2.

    KeyboardInterrupt ends quietly with status 130. Returns main's int result or 0.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(args)
    args = [arg for arg in args if arg != DEBUG_FLAG]
    try:
        result = main(args)
    except (UserError, FileNotFoundError) as err:
        if debug:
            raise
        print(f"error: {one_line(err)}", file=sys.stderr, flush=True)
        return USAGE_EXIT
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    return result if isinstance(result, int) else 0


def one_line(err: BaseException) -> str:
    """The message of an exception on one line (FileNotFoundError: its text, not its repr)."""
    if isinstance(err, OSError) and err.filename and err.strerror:
        text = f"{err.strerror}: {err.filename}"
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


def first_detail(err: BaseException) -> str:
    """The first informative line of a many-line message, e.g. torch's `Error(s) in loading state_dict ...:`
    followed by one `size mismatch for ...` line per tensor: that first mismatch."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]


def exit_with(main: Callable[[list[str]], object]) -> None:
    """`if __name__ == "__main__": exit_with(main)`."""
    sys.exit(run_main(main))
