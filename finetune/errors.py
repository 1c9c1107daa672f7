"""The exception types whose message is the whole story: the command line prints it alone, without a traceback.

Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, explained in the message: what is wrong, where, and what to do. Exit 2."""

    exit_code = 2


class CommandFailed(UserError):
    """The input was fine but the work did not succeed (an export's self-check, an upload). Exit 1."""

    exit_code = 1
