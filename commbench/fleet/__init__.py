"""Many runs as one dataset: a fleet of boxes qualified together (docs/fleet.md).

build.py reads run dirs (and NCCL Inspector JSONL, inspector.py) through the validated readers
into a Parquet dataset (store.py); verdicts.py applies a spec to every node and compares each
node with the fleet (outliers.py); exports.py writes JSON, JUnit and a Prometheus textfile,
page.py the fleet's HTML page; command.py is `commbench fleet`. pyarrow and duckdb are the
optional `fleet` extra (deps.py says so in one line when they are missing). Torch-free.
"""
