"""The impact result: per site the share of the output gap it recovers, with its noise band;
its JSON form ({"format": "accucheck-impact", "version": 1}) and its text table. Imports
impact.gap and accucheck.numbers only (no torch), so a reader of impact.json needs nothing heavy.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from accucheck.impact.gap import METRICS, Gap
from accucheck.numbers import number, percent

FORMAT = "accucheck-impact"
VERSION = 1


@dataclass(frozen=True)
class SiteImpact:
    """One patched site. recovered / band: metric -> share of the baseline gap recovered by
    the reference's / the control's tensor (None: no gap on that metric); when noising, the
    share of the candidate's gap the candidate's / the control's tensor brings in. band_missing:
    why the control could not patch this site."""
    site: str
    level: str  # "site" (selected), "child" (--bisect) or "all" (every site at once)
    mode: str  # "update" (a layer block's residual update), "output", "ids" (a router's
    #            expert ids only: `routing`), "-" for all
    gap: Gap
    recovered: dict
    band: dict | None
    band_missing: str | None

    def score(self) -> float:
        """The ranking key: recovered |Δ logprob|, else KL, else flips."""
        for m in METRICS:
            v = self.recovered.get(m)
            if v is not None and math.isfinite(v):
                return v
        return -math.inf

    def as_dict(self, share: str = "recovered") -> dict:
        """`share`: the key of the share ("recovered"; "introduced" when noising)."""
        return {"site": self.site, "level": self.level, "mode": self.mode,
                "patched_gap": self.gap.as_dict(), share: self.recovered,
                "band": self.band, "band_missing": self.band_missing}


@dataclass(frozen=True)
class ImpactResult:
    ref: str
    control: str | None
    device: str
    dtype: str
    baseline: Gap
    control_gap: Gap | None
    sites: tuple[SiteImpact, ...]
    together: SiteImpact | None
    children: tuple[SiteImpact, ...]
    skipped: tuple[tuple[str, str], ...]
    runs: int
    seconds: float
    bisect: int
    prompts: tuple[str, ...] = ()  # REF's prompts, in request order ("" where not stored)
    noising: str | None = None     # the candidate's capture whose tensors were patched in
    total: Gap | None = None       # noising: the candidate's own gap (its logits against REF's)
    # MoE: each patched router again with REF's expert ids only, its weights the candidate's
    # own at those experts (capture.record.moe.RoutingReplay): how much the routing choice
    # explains, against its whole output (ids, weights, logits) in `sites`
    routing: tuple[SiteImpact, ...] = ()
    # --answers FILE (impact.answers): per request whether REF's answer is right (None: the
    # file has no answer for its prompt); () without the file
    ref_right: tuple[bool | None, ...] = ()
    answers_file: str | None = None

    @property
    def method(self) -> str:
        return "noising" if self.noising else "denoising"

    @property
    def share_key(self) -> str:
        return "introduced" if self.noising else "recovered"

    def answers(self) -> dict:
        """The eval view: which prompts' greedy answers differ from REF's (baseline) and, per
        patched site, the prompts whose answer its patch restores (and any it breaks)."""
        differ = set((self.total or self.baseline).answers)
        rows = []
        for s in list(self.sites) + list(self.children):
            got = set(s.gap.answers)
            if self.noising:  # the candidate's tensor alone makes these answers differ
                rows.append({"site": s.site, "level": s.level,
                             "reproduced": sorted(differ & got), "new": sorted(got - differ)})
            else:
                rows.append({"site": s.site, "level": s.level,
                             "restored": sorted(differ - got), "broken": sorted(got - differ)})
        first, second = ("reproduced", "new") if self.noising else ("restored", "broken")
        out = {"prompts": len(self.prompts), "differ": sorted(differ), "by_site": rows}
        if self.ref_right:  # the score drops first: prompts REF answers right
            right = {i for i, v in enumerate(self.ref_right) if v}
            out.update(file=self.answers_file, ref_right=sorted(right),
                       ref_wrong=[i for i, v in enumerate(self.ref_right) if v is False],
                       drops=sorted(differ & right))
            for r in rows:
                r["drops_" + first] = sorted(set(r[first]) & right)
            rows.sort(key=lambda x: (-len(x["drops_" + first]), -len(x[first]), len(x[second])))
        else:
            rows.sort(key=lambda x: (-len(x[first]), len(x[second])))
        return out

    @property
    def no_gap(self) -> bool:
        """No gap to attribute: the candidate run matches REF (denoising); the candidate's
        capture matches REF (noising)."""
        return (self.total or self.baseline).is_zero()

    @property
    def within_noise(self) -> bool:
        """The gap to attribute is no larger than the control's own (a correct device's logits
        against REF's) on every metric: rounding alone, as far as one control can tell. Every
        site's share is still measured, but none is named (`leaders` is empty): a share of a
        gap that is rounding only swings by tens of percent either way, and a difference
        `diff` calls more than noise at its record may still not reach the output beyond a
        correct device's (docs/impact.md)."""
        c = self.control_gap
        return (c is not None and not self.no_gap
                and all((self.total or self.baseline).value(m) <= c.value(m) for m in METRICS))

    def top(self) -> SiteImpact | None:
        """The site that recovers most (children included), None without a gap or within
        the noise."""
        return self.leaders()[0] if self.leaders() else None

    def leaders(self, within: float = 0.01) -> list[SiteImpact]:
        """The sites whose share is within `within` of the best, finest first: a child of a
        block replaces the block (denoising cannot tell a module from its only consumer: a norm
        and the MLP it feeds recover alike). None within the noise (`within_noise`)."""
        rows = list(self.sites) + list(self.children)
        if not rows or self.within_noise:
            return []
        best = max(s.score() for s in rows)
        tied = [s for s in rows if s.score() >= best - within]
        kids = [s for s in tied if s.level == "child"]
        return kids + [s for s in tied if s.level != "child"
                       and not any(k.site.startswith(s.site + ".") for k in kids)]

    def headline(self) -> str:
        if self.no_gap:
            return (f"no output gap: the candidate's logits match REF's (mean |Δ logprob| "
                    f"{number(self.baseline.logprob)}, KL {number(self.baseline.kl)}, 0 flips); "
                    f"nothing to recover")
        if self.within_noise:
            g, c = self.total or self.baseline, self.control_gap
            return (f"the candidate's output gap (mean |Δ logprob| {number(g.logprob)}, KL "
                    f"{number(g.kl)}, {g.flips} flip(s)) is within the control's own "
                    f"(|Δ logprob| {number(c.logprob)}, KL {number(c.kl)}, {c.flips} flip(s)): "
                    f"no larger than a correct device's, no site to blame")
        t = self.top()
        names = " and ".join(s.site for s in self.leaders())
        one = len(self.leaders()) == 1
        verb = ("introduces" if one else "each introduce") if self.noising else \
            ("recovers" if one else "each recover")
        return (f"{names} {verb} {_pct(t.recovered.get('logprob'))} of the |Δ logprob| gap "
                f"({_pct(t.recovered.get('kl'))} of KL, {_pct(t.recovered.get('flips'))} of "
                f"flips)")

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "ref": self.ref, "control": self.control,
                "device": self.device, "dtype": self.dtype, "method": self.method,
                "noising": self.noising,
                "baseline": self.baseline.as_dict(), "no_gap": self.no_gap,
                "within_noise": self.within_noise,
                "total": self.total.as_dict() if self.total else None,
                "control_gap": self.control_gap.as_dict() if self.control_gap else None,
                "sites": [s.as_dict(self.share_key) for s in self.sites],
                "all_sites": self.together.as_dict(self.share_key) if self.together else None,
                "bisect": {"k": self.bisect,
                           "children": [s.as_dict(self.share_key) for s in self.children]},
                "routing": [s.as_dict(self.share_key) for s in self.routing],
                "not_patchable": [{"site": s, "why": w} for s, w in self.skipped],
                "runs": {"count": self.runs, "seconds": round(self.seconds, 3)},
                "prompts": list(self.prompts), "answers": self.answers(),
                "leaders": [s.site for s in self.leaders()], "headline": self.headline()}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2) + "\n"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else percent(0.0 if abs(v) < 5e-4 else v)  # no "-0.0%"


def _band(s: SiteImpact) -> str:
    if s.band is not None:
        return " / ".join(_pct(s.band.get(m)) for m in METRICS)
    return "-" if s.band_missing is None else "not patchable"


def render(res: ImpactResult) -> str:
    """The text table: one row per site, recovered share per metric, and the band."""
    from tabulate import tabulate

    b = res.baseline
    if res.noising:
        t = res.total
        lines = [f"noising: {res.noising}'s tensors patched into a reference-device run "
                 f"({res.device}, {res.dtype}), teacher-forced to {res.ref}:",
                 f"the candidate's gap: mean |Δ logprob| {number(t.logprob)} over {t.targeted} "
                 f"tokens, mean KL {number(t.kl)} over {t.positions} positions, {t.flips} token "
                 f"flip(s)",
                 f"the rerun's own gap (nothing patched): mean |Δ logprob| {number(b.logprob)}, "
                 f"mean KL {number(b.kl)}, {b.flips} flip(s)"]
    else:
        lines = [f"impact of {res.ref} on the candidate ({res.device}, {res.dtype}), "
                 f"teacher-forced:",
                 f"baseline gap: mean |Δ logprob| {number(b.logprob)} over {b.targeted} tokens, "
                 f"mean KL {number(b.kl)} over {b.positions} positions, {b.flips} token flip(s)"]
    if res.control_gap is not None:
        g = res.control_gap
        lines.append(f"control's own gap: mean |Δ logprob| {number(g.logprob)}, mean KL "
                     f"{number(g.kl)}, {g.flips} flip(s)")
    rows = list(res.sites) + list(res.routing) + ([res.together] if res.together else []) \
        + list(res.children)
    if rows:
        x = "intro" if res.noising else "rec"
        heads = ["site", "patch", f"Δlogprob {x}", f"KL {x}", f"flips {x}", "band (lp / KL / fl)"]
        table = [[s.site if s.level != "child" else "  " + s.site, s.mode,
                  *(_pct(s.recovered.get(m)) for m in METRICS), _band(s)] for s in rows]
        lines.append(tabulate(table, heads, disable_numparse=True))
    lines += answer_lines(res)
    for site, why in res.skipped:
        lines.append(f"not patchable: {site}: {why}")
    lines.append(f"{res.runs} forward run(s) (teacher-forced, every prompt and step) in "
                 f"{res.seconds:.2f} s")
    lines.append(res.headline())
    return "\n".join(lines) + "\n"


def _prompt(res: ImpactResult, i: int) -> str:
    text = res.prompts[i] if i < len(res.prompts) else ""
    text = " ".join(text.split())
    return f"#{i}" + (f" {text[:40]!r}" if text else "")


def answer_lines(res: ImpactResult, top: int = 10) -> list[str]:
    """The eval view as text: the prompts whose greedy answer differs from REF's, and the
    sites whose patch restores them (site -> prompts restored)."""
    a = res.answers()
    if not a["differ"]:
        return [f"answers: every prompt's greedy answer is REF's ({a['prompts']} prompt(s))"] \
            if res.sites else []
    out = [f"answers: {len(a['differ'])} of {a['prompts']} prompt(s) answer otherwise than REF: "
           + ", ".join(_prompt(res, i) for i in a["differ"])]
    if "drops" in a:
        known = len(a["ref_right"]) + len(a["ref_wrong"])
        drops = a["drops"]
        out.append(f"reference answers ({Path(a['file']).name}): REF answers "
                   f"{len(a['ref_right'])} of {known} right; "
                   + (f"{len(drops)} prompt(s) that differ lost a right answer (a score "
                      f"drop): " + " ".join(f"#{i}" for i in drops) if drops else
                      "no prompt that differs loses a right answer"))
    first, second = ("reproduced", "new") if res.noising else ("restored", "broken")
    rows = [r for r in a["by_site"] if r[first]][:top]
    if rows:
        from tabulate import tabulate

        drops = "drops" in a
        out.append(tabulate([[r["site"], f"{len(r[first])} / {len(a['differ'])}",
                              *([f"{len(r['drops_' + first])} / {len(a['drops'])}"]
                                if drops else []),
                              " ".join(f"#{i}" for i in r[first]),
                              " ".join(f"#{i}" for i in r[second]) or "-"] for r in rows],
                            ["site", first, *([f"score drops {first}"] if drops else []),
                             f"prompts {first}", f"prompts {second}"],
                            disable_numparse=True))
    done = {i for r in a["by_site"] for i in r[first]}
    lost = [i for i in a["differ"] if i not in done]
    if lost:
        verb = "reproduces" if res.noising else "restores"
        out.append(f"no patched site {verb} " + ", ".join(_prompt(res, i) for i in lost)
                   + " alone (patch inside the blocks: --bisect K, or --include)")
    return out
