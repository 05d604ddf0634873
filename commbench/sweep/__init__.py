"""The measuring half: `commbench sweep`.

command (the CLI) -> launcher (the --nproc/--env driver, MPS) -> context (ranks, device,
groups) -> plan (sizes, dtypes, modes, calls) -> engine (per backend: vote, setup; per row:
observe, warm up, timed pass, jitter pass, check) with timing, workload and watchdog -> rows in
the results dir (commbench.results), shown live by live. Backends come from commbench.backends;
the topology snapshot and verdicts from commbench.topology.
"""
