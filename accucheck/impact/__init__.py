"""Impact: which module's difference causes the output difference, and how much of it.

`accucheck impact REF.h5 MODEL` reruns the candidate teacher-forced to REF's tokens with one
site's output swapped for REF's recorded tensor (denoising) and reports the share of the logit
gap each site recovers (docs/impact.md). A stage of its own over the bottom and capture (it runs
the model); only signoff (a scenario's [impact]) and the top layer (cli) import it.
"""
