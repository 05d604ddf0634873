import os
import sys

from commbench.cli import main
from commbench.runtime.context import under_torchrun

status = main()
if under_torchrun():
    # A torchrun worker whose results are on disk leaves without C++ teardown: torch.distributed's
    # background threads can abort a finished rank at interpreter exit ("terminate called without
    # an active exception", seen with two gloo agents), which torchrun reports as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
raise SystemExit(status)
