"""Report stage: renderers only, no measuring. `diff`: the diff report (`render(analysis, fmt)`:
table / json / csv / md, `verdict_line`, `to_json`); `html_diff`: the diff as one page
(`to_html`; `html_curves`: its charts; `html_assets`: its CSS and script); `signoff`: the
sign-off report files (`write_report`); `signoff_result`: the records the sign-off run fills and the report renders.
Imports verdict, compare and the bottom layer; never torch.
"""
from accucheck.report.diff import render, to_json, verdict_line

__all__ = ["render", "to_json", "verdict_line"]
