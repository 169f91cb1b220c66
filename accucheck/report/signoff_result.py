"""The sign-off's result records (`SignoffResult` and its `Check`, `Metrics`, `EnvRow`,
`Regression`). Data only (numbers are written by accucheck.numbers): the sign-off run
(accucheck.signoff) makes them, the sign-off report (report.signoff) renders them, and the
report does not import the run. Imports errors and verdict (Analysis); the scenario type only
by name (signoff sits above report).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from accucheck.errors import EXIT_DIVERGENCE, EXIT_OK
from accucheck.numbers import number
from accucheck.verdict.locate import Analysis


@dataclass(frozen=True)
class Check:
    """One threshold applied to the diff. `op` is "<=" or ">=" (value op limit must hold)."""
    name: str
    passed: bool
    value: float | int | None
    limit: float | int | None
    op: str
    detail: str


@dataclass(frozen=True)
class Metrics:
    """Headline numbers of one comparison (None: nothing to measure, e.g. no logits stored)."""
    records_compared: int
    records_over_tolerance: int
    missing_keys: int
    basis: str                        # "tensor" | "sample" | "stats" | "mixed"
    max_layer_rel_l2: float | None    # decoder-layer outputs, all steps and requests
    min_layer_cosine: float | None
    max_logits_kl: float | None
    top1_agreement: float | None      # over every compared logits position
    logits_positions: int
    token_agreement: float | None     # over generated tokens (see token_stats)
    tokens_compared: int
    near_tie_flips: int
    real_flips: int
    routing_agreement: float | None = None  # MoE: share of token routings whose expert set
                                            # agrees (None: no router)
    routing_flips: int = 0
    real_routing_flips: int = 0             # first flips of a request that are not near-ties

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class EnvRow:
    field: str
    ref: str
    cand: str

    @property
    def differs(self) -> bool:
        return self.ref != self.cand


@dataclass(frozen=True)
class RegressionItem:
    metric: str
    previous: float | int | None
    current: float | int | None
    change: str                       # "same" | "better" | "worse" | "n/a"


@dataclass(frozen=True)
class Regression:
    previous: str                     # path of the previous report.json / capture
    verdict: str                      # "same" | "better" | "worse"
    items: tuple[RegressionItem, ...]
    note: str = ""

    @property
    def sentence(self) -> str:
        return {"same": "same as last release", "better": "better than last release",
                "worse": "worse than last release"}[self.verdict]


@dataclass(frozen=True)
class SignoffResult:
    """The verdict and its evidence. bool() = pass; `exit_code` 0 pass / 1 fail."""
    scenario: Scenario  # accucheck.signoff.scenario.Scenario, by name: signoff is above
    analysis: Analysis
    ref_path: str
    cand_path: str
    golden_path: str | None
    ref_meta: dict
    cand_meta: dict
    metrics: Metrics
    checks: tuple[Check, ...]
    environment: tuple[EnvRow, ...]
    regression: Regression | None
    seconds: float
    out_dir: Path | None = None
    control_paths: tuple[str, ...] = ()   # the control runs the verdict was judged against
    matrix: dict | None = None      # the scenario's configuration matrix (matrix.json)
    impact: dict | None = None      # [impact]: "line" (beside the culprit), "site" (the
                                    # culprit's patched site), "headline", "file" and
                                    # "result" (accucheck impact's result: impact.json)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def __bool__(self) -> bool:
        return self.passed

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "fail"

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.passed else EXIT_DIVERGENCE

    @property
    def failed_checks(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if not c.passed)

    @property
    def planted_faults(self) -> list[str]:
        return [f"{role}: {m['planted_fault']}" for role, m in
                (("reference", self.ref_meta), ("candidate", self.cand_meta))
                if m.get("planted_fault")]

    @property
    def culprit(self) -> str | None:
        """The diff's culprit (module#call / op@index), the same one `accucheck diff` names."""
        c = self.analysis.culprit
        return c.where if c is not None else None

    @property
    def summary(self) -> str:
        """The verdict sentence: PASS / FAIL and why, in one sentence."""
        s, m = self.scenario, self.metrics
        what = f"{s.name}: {s.candidate.label} vs {s.reference.label}"
        noise = self.analysis.location.noise
        if self.passed:
            bits = [f"{m.records_compared} records within tolerance" if noise is None else
                    f"{len(noise.records)} records within the control's noise"]
            if m.max_layer_rel_l2 is not None:
                bits.append(f"max layer rel_l2 {number(m.max_layer_rel_l2)}")
            if m.token_agreement is not None:
                bits.append(f"token agreement {m.token_agreement:.1%}")
            if m.near_tie_flips:
                bits.append(f"{m.near_tie_flips} near-tie token flip(s) allowed")
            if m.routing_flips:
                bits.append(f"MoE routing agreement {m.routing_agreement:.2%} ("
                            f"{m.routing_flips} near-tie routing flip(s); the records after "
                            f"them compare other experts and are not judged)")
            if self.regression is not None:
                bits.append(self.regression.sentence)
            return f"PASS: {what}: " + ", ".join(bits) + "."
        fd = self.analysis.location.first_divergence
        why = []
        if fd is not None and fd.noise is not None:
            lead_of = self.analysis.location.noise.lead_of
            why.append(f"more than noise from step {fd.step}, {self.culprit} (excess "
                       f"x{number(fd.noise.excess)} over the control's noise, threshold "
                       f"x{number(fd.noise.threshold)}"
                       + (f"; the origin of {lead_of.site}, more than noise downstream"
                          if lead_of is not None else "") + ")")
        elif fd is not None:
            rec = self.analysis.diff.record(fd.key)
            gold = f", golden: {rec.golden.label}" if rec.golden is not None else ""
            why.append(f"divergence starts at step {fd.step}, {self.culprit} "
                       f"({fd.cause}, rel_l2 {number(fd.error)} > tolerance "
                       f"{number(fd.tolerance)}{gold})")
        elif self.analysis.location.diffuse:
            fo = self.analysis.location.first_over
            sus = self.analysis.location.suspicious
            up = (f"; SUSPICIOUS upstream: {sus[0].key.module} ({sus[0].key}, x"
                  f"{number(sus[0].ratio)} its peers)" if sus else "")
            nl = self.analysis.location.noise_like
            why.append(f"error over tolerance but introduced by no record (diffuse / inherited),"
                       f" first at step {fo.step} {fo.module}; no culprit named{up}"
                       if nl is None else
                       f"error over tolerance, first at step {fo.step} {fo.module}; no culprit "
                       f"named ({self.analysis.location.no_culprit_reason}){up}")
        for c in self.failed_checks:
            if c.name in ("records", "noise") and (fd is not None
                                                   or self.analysis.location.diffuse):
                continue
            why.append(c.detail)
        return f"FAIL: {what}: " + "; ".join(why) + "."


WORST_ROWS = 12


def worst_records(r: SignoffResult) -> list:
    """Records over tolerance that introduce their error first (the culprit leads), then the
    rest by error / tolerance."""
    a = r.analysis
    locs = {str(x.key): x for x in a.location.records}
    fd = a.location.first_divergence

    def rank(x):
        first = fd is not None and x.key == fd.key
        intro = locs[str(x.key)].cause == "introduced"
        return (not first, not intro, -(x.error / max(x.tolerance.rel_l2, 1e-300)))
    return sorted((x for x in a.diff.records if x.key.role != "in"), key=rank)[:WORST_ROWS]
