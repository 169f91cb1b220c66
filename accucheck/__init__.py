"""accucheck: numerical-accuracy comparison for LLM inference (GPU vs NPU, eager vs graph).

`import accucheck` needs neither torch nor torch_npu; capture entry points import torch lazily.

The tree is the pipeline; imports only go down it (tests/test_layout.py):
bottom (store, keys, errors, prompts, paths) < compare (align two captures, measure each pair)
< verdict (where divergence starts, the culprit) < report (renderers) < signoff (scenario, run)
< cli, demo, inspect, replay. capture (recording runs) and importers (other tools' dumps) sit
beside them over the bottom layer.
"""
__version__ = "0.1.0"
