"""Compare stage: align two captures and measure each pair of records.

- `diff`: `diff_captures(ref, cand)` -> `DiffResult` (every record's metrics, tolerances,
  logits and token comparison);
- `opmatch`: aligning op-level records of two runs (fused / absent ops);
- `metrics`: the per-tensor error metrics (rel L2, cosine, KL, ...);
- `tolerances`: per-record tolerances (`ToleranceTable`) and the verdict rule's numbers;
- `weights`: weight-hash notes; `compat`: the same-model check.

Imports the bottom layer (store, keys, errors) only; never torch.
"""
