"""Verdict stage: where divergence starts (`locate`), who introduces it (`culprit`), and the
records both read (`types`). `analyze(ref, cand)` = compare.diff + locate: what
`accucheck diff` runs. Imports compare and the bottom layer; never torch.
"""
from accucheck.verdict.locate import Analysis, analyze, locate

__all__ = ["Analysis", "analyze", "locate"]
