"""The one exception type for mistakes a user can fix: shown as one line, exit code 2."""


class UserError(Exception):
    """A problem with the user's input. The message names the problem and the fix."""


class RankError(UserError):
    """A problem only the rank that met it knows (a damaged block of data it read): that rank prints
    it, whichever it is; the others only see a peer gone."""


EXIT_USAGE = 2


def first_line(exc: BaseException) -> str:
    """The head of a library's error message, for a one-line report."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
