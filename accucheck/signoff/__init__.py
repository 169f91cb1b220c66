"""Sign-off stage: `scenario` (the scenario file: what to capture, compare and require) and
`run` (the sign-off run: scenario -> captures -> diff -> thresholds -> verdict -> report files).
Imports report, verdict, compare, the bottom layer and (lazily, to capture) capture.
"""
from accucheck.report.signoff_result import SignoffResult
from accucheck.signoff.run import capture_only, signoff
from accucheck.signoff.scenario import Scenario, load_scenario

__all__ = ["Scenario", "SignoffResult", "capture_only", "load_scenario", "signoff"]
