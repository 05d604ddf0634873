"""The measuring half: `commbench sweep`.

command (the CLI; options: the sweep's own flags) -> launcher (the --nproc/--env driver, MPS)
-> plan (sizes, dtypes, modes, calls) -> engine (per backend: vote, setup; per row: observe,
warm up, timed pass, jitter pass, check) with watchdog -> rows in the results dir
(commbench.results), shown live by live. Backends come from commbench.backends, and what they
run on (context, timing, workload) from commbench.runtime, below them; the topology snapshot
and verdicts from commbench.probe.
"""
