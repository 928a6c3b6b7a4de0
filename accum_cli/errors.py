"""The one exception type for mistakes a user can fix: shown as one line, exit code 2."""


class UserError(Exception):
    """A problem with the user's input. The message names the problem and the fix."""


EXIT_USAGE = 2


def first_line(exc: BaseException) -> str:
    """The head of a library's error message, for a one-line report."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
