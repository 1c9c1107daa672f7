"""The one exception type for problems the user can fix (bad recipe, bad data, missing files).

The command line prints its message alone and exits with status 2; anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, explained in the message: what is wrong, where, and what to do."""

    exit_code = 2
