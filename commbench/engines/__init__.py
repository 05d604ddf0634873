"""Engine knowledge: what vLLM and SGLang do with a tensor-parallel allreduce, one engine per file.

  vllm.py, sglang.py  each engine whole: its facts with their sources, its paths in the order its
                      own all_reduce tries them, their gates on a box, its words, its start-up log's
                      names, its prefill default, its inert settings and the gate probes --check runs
  registry.py         the one list of engines, and of the libraries checked like them
  libs.py             NCCL, FlashInfer, torch symm-mem: their facts and the gates they set
  flashinfer.py       FlashInfer's facts (kernel names, pattern numbers, rank counts), checked by --check
  paths.py            the shared path model: which path takes a size under a launch line, and what a
                      line must add for its path to take the sizes it claims (knows no engine)
  facts.py            a fact, and SourceTree, the one reader of an engine's files (ast, kernel names),
                      bounded: regular files, bytes read, arithmetic  values.py  a fact's kinds
  source.py           installed engine / --engine-site / built in, resolved once per command
  settings.py         what backends declare, paste-ready lines, settings inert on a box
  log.py              an engine's start-up chain       explain.py  the probe's explain section
  check.py, gates.py, gate_child.py, probes.py   `engines --check`: facts, gates and dispatch order
The package namespace is settings.py's: `from commbench import engines; engines.Settings`.
No torch at import time: the analysis reads it (the gate check imports torch in its child process).
"""

from commbench.engines.settings import *  # noqa: F401,F403
