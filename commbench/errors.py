"""Errors that the CLI turns into one line, and the exit statuses commbench uses."""


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2, nothing written."""


class ResultsUnwritable(Exception):
    """The results dir stopped taking writes (a full disk, a lost mount): one line, exit status
    1; every row written before it is intact and --resume continues once it is writable."""


FAILED_EXIT = 1   # the command could not finish (unwritable results)
USAGE_EXIT = 2
HANG_EXIT = 3  # a rank's watchdog fired; the hang row is on disk
