"""What a backend uses while it runs, below the backends and above the results contract.

context (ranks, device, groups, identity), timing (CUDA events and host clocks around a timed
loop), workload (a row's input/output pairs, one call per pair, and the check of every call),
dtypes (names and exact-integer ranges). Together with commbench.backends.base this is the
plug-in API; nothing here imports a backend, the sweep or the probe.
"""
