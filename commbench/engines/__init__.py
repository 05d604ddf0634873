"""Engine knowledge: what vLLM, SGLang and NCCL do with a tensor-parallel allreduce.

One home, one job per module, every fact data with its provenance:
  facts.py     a fact (value, engine version, source file:line / env var / flag) and its ast reader
  vllm.py      vLLM's facts, built in        sglang.py   SGLang's facts, built in
  libs.py      NCCL and FlashInfer facts     source.py   installed engine / --engine-site / built in; --check
  settings.py  the settings that select a path, paste-ready lines, settings inert on a box
  paths.py     the path model: gates, dispatch order and defaults applied to a probed box
  log.py       the dispatch chain an engine's own start-up log names
The package namespace is settings.py's: `from commbench import engines; engines.Settings`.
No torch anywhere here: the analysis reads it.
"""

from commbench.engines.settings import *  # noqa: F401,F403
