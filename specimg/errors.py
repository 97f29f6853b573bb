"""The one exception type for mistakes a user can make (bad option, wrong checkpoint...).

The CLI turns it into a single-line message and exit status 2; anything else is a bug
and keeps its traceback.
"""


class SpecimgError(Exception):
    """A user-caused error with a message that says what to fix."""
