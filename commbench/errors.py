"""Errors that the CLI turns into one line and exit status 2."""


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2, nothing written."""


USAGE_EXIT = 2
HANG_EXIT = 3  # a rank's watchdog fired; the hang row is on disk
