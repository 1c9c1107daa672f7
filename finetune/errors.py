"""The exception types whose message is the whole story: the command line prints it alone, without a traceback.

Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, explained in the message: what is wrong, where, and what to do. Exit 2.

    Under DDP every process meets it alike, so only the main one prints it."""

    exit_code = 2
    every_process_alike = True


class CommandFailed(UserError):
    """The input was fine but the work did not succeed (an export's self-check, an upload, a run). Exit 1."""

    exit_code = 1


class RunFailed(CommandFailed):
    """A run that started ended in failure (non-finite loss, out of memory, a checkpoint that could not be
    written); the message says at which step, what is kept and what to try."""

    def __init__(self, message: str, every_process_alike: bool = True):
        super().__init__(message)
        self.every_process_alike = every_process_alike
