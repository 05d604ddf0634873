"""Errors that the CLI turns into one line, and the exit statuses commbench uses."""


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2, nothing written."""


class ResultsUnwritable(Exception):
    """The results dir stopped taking writes (a full disk, a lost mount): one line, exit status
    1; every row written before it is intact and --resume continues once it is writable."""


FAILED_EXIT = 1   # the command could not finish (unwritable results, a driver child that failed)
USAGE_EXIT = 2
# A backend hung, crashed, or raised on one rank while its peers were inside a collective,
# during this command; its rows say which. The --nproc driver still finished every other
# backend; a torchrun worker ends with it (torchrun itself then exits 1) and --resume continues.
STOP_EXIT = 3
TERMINATED_EXIT = 143   # 128 + SIGTERM, as a shell reports a process it ended
# Set by the --nproc driver for its children: a child's bad-input line goes into this file, for
# the driver to say it once and exit USAGE_EXIT (torchrun reports any failed worker as exit 1).
USAGE_LINE_FILE_VAR = "COMMBENCH_USAGE_LINE_FILE"


class Terminated(BaseException):
    """SIGTERM arrived (torchrun stopping its workers, the driver, kill): unwinds like Ctrl-C,
    never caught as a backend's failure."""
