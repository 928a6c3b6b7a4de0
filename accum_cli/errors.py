"""The one exception type for mistakes a user can fix: shown as one line, exit code 2."""


class UserError(Exception):
    """A problem with the user's input. The message names the problem and the fix."""


EXIT_USAGE = 2
