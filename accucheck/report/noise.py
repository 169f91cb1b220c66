"""The control rule's evidence (accucheck.verdict.noise) as text lines and JSON. Imports
verdict (noise, types); formats only."""
from __future__ import annotations


from accucheck.verdict.noise import layer_ratios
from accucheck.verdict.types import NoiseSite, NoiseVerdict
from accucheck.numbers import number

MAX_SITES = 6   # sites listed in the text report



def _site_json(s: NoiseSite) -> dict:
    return {"site": s.site, "kind": s.kind, "key": str(s.key), "excess": s.excess,
            "threshold": s.threshold, "z": s.z, "records": s.records,
            "location": s.location, "spread": s.spread, "peers": s.peers,
            "flagged": s.flagged, "disagreement": s.disagreement}


def _wider(s: NoiseSite) -> str:
    return f", x{number(s.disagreement)} wider: the control runs disagree here" \
        if s.disagreement >= 1.005 else ""


def control_json(v: NoiseVerdict | None) -> dict | None:
    """Every record's ratio to the controls, the sites judged, the per-layer curve; None
    without control runs."""
    if v is None:
        return None
    return {"paths": list(v.controls),
            "flagged": [_site_json(s) for s in v.flagged],
            "sites": [_site_json(s) for s in v.sites[:20]],
            "layers": [{"layer": ly, "ratio": r, "max_excess": m, "site": site}
                       for ly, r, m, site in layer_ratios(v)],
            "records": [{"key": str(x.key), "error": x.error, "expected": x.expected,
                         "controls_min": x.spread[0], "controls_max": x.spread[1],
                         "ratio": x.ratio, "input_ratio": x.input_ratio, "excess": x.excess}
                        for x in v.records]}


def control_lines(v: NoiseVerdict, fmt: str) -> list[str]:
    """What the control runs say: the sites more than noise (or the closest ones), and the
    candidate/control ratio per layer."""
    from tabulate import tabulate

    k = len(v.controls)
    lines = [f"{k} control run{'s' if k > 1 else ''}: {', '.join(v.controls)}. Ratio = the "
             f"candidate's elementwise relative error / the controls' (their mean; the RMS "
             f"from the sketches in the stats store); excess = ratio over the ratio of what "
             f"feeds it, geometric mean over a site's records."]
    shown = list(v.flagged[:MAX_SITES]) or list(v.sites[:3])
    if not v.flagged:
        lines.append("No site is more than noise; the closest:")
    for s in shown:
        lines.append(f"{'MORE THAN NOISE' if s.flagged else 'within noise'}: {s.site}: excess "
                     f"x{number(s.excess)} over {s.records} records (threshold "
                     f"x{number(s.threshold)}: its {s.peers} peers' spread"
                     f"{_wider(s)}), first at {s.key}")
    if len(v.flagged) > MAX_SITES:
        lines.append(f"... {len(v.flagged) - MAX_SITES} more sites (--format json)")
    rows = [[ly, f"x{number(r)}", f"x{number(m)}", site] for ly, r, m, site in layer_ratios(v)]
    if rows:
        lines += ["", tabulate(rows, ["layer", "cand/control at output",
                                      "largest excess inside", "at"],
                               tablefmt=fmt, disable_numparse=True)]
    return lines
