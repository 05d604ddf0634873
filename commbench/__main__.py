import os
import sys

try:
    # Ctrl-C can come at any moment, also while torch and the subcommands are still importing.
    from commbench.cli import main
    from commbench.launch_env import under_torchrun

    status = main()
except KeyboardInterrupt:
    print("commbench: interrupted", file=sys.stderr)
    raise SystemExit(130) from None
if under_torchrun():
    # A torchrun worker whose results are on disk leaves without C++ teardown: torch.distributed's
    # background threads can abort a finished rank at interpreter exit ("terminate called without
    # an active exception", seen with two gloo agents), which torchrun reports as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
raise SystemExit(status)
