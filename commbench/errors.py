"""Errors that the CLI turns into one line, and the exit statuses commbench uses."""

import errno
import signal


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
    """SIGTERM (or SIGHUP) arrived (torchrun stopping its workers, the driver, kill, a closed
    terminal): unwinds like Ctrl-C, never caught as a backend's failure; the process exits
    128 + the signal, as a shell reports it."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


# A write that failed for want of room, and one the file system refused: what to do differs.
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_REFUSED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


def write_advice(exc: OSError) -> str:
    """What to do about a failed write, by its errno: make room (a full disk, a quota, a file
    size limit), make the place writable (permission denied, a read-only mount), else retry."""
    if exc.errno in NO_ROOM:
        return "make room and run the command again"
    if exc.errno in _REFUSED:
        return "make it writable for this user and run the command again"
    return "run the command again once it can be written"
