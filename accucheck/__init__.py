"""accucheck: numerical-accuracy comparison for LLM inference (GPU vs NPU, eager vs graph).

`import accucheck` needs neither torch nor torch_npu; capture entry points import torch lazily.
"""
__version__ = "0.1.0"
