"""MoE routing in reports (accucheck.compare.routing): the headline's routing clause, the text
section and the JSON. Imports compare.routing; formats only."""
from __future__ import annotations

from accucheck.compare.routing import AFTER_FLIP, RoutingResult, flip_line

MAX_ROUTERS = 24  # routers listed in the text report


def routing_clause(routing: RoutingResult | None, records) -> str:
    """"; MoE routing: 3 of 640 token routings differ, first r0.s0:… (near-tie: …); 812
    records after it not judged (--routing-from REF to compare past it)", or "" when every
    token went to the same experts."""
    if routing is None or routing.first_flip is None:
        return ""
    after = sum(r.routing == AFTER_FLIP for r in records)
    tail = (f"; {after} records after it not judged (capture the candidate with "
            f"--routing-from REF to compare past it)") if after else ""
    return (f"; MoE routing: {routing.flipped} of {routing.tokens} token routings differ, "
            f"first {flip_line(routing.first_flip)}{tail}")


def routing_lines(routing: RoutingResult, fmt: str) -> list[str]:
    """Per router: tokens, flips, weights differing, agreement, first flip; expert blame."""
    from tabulate import tabulate

    rows = []
    for d in routing.per_router()[:MAX_ROUTERS]:
        f = d["first_flip"]
        rows.append([d["router"], d["tokens"], d["flipped"], d["weights_differ"],
                     f"{100 * d['agreement']:.2f} %",
                     "-" if f is None else f"r{f['req']}.s{f['step']} token {f['token']}: "
                     f"{f['ref_experts']} -> {f['cand_experts']} ({f['label']})"])
    out = []
    if routing.forced:
        out.append(f"routing forced from {routing.forced.get('from')} ("
                   + ("ids and weights" if routing.forced.get("weights") else "ids") + ")")
    out.append(f"agreement {100 * routing.agreement:.2f} % ({routing.flipped} of "
               f"{routing.tokens} token routings differ)")
    out.append(tabulate(rows, ["router", "tokens", "flipped", "weights differ", "agreement",
                               "first flip"], tablefmt=fmt, disable_numparse=True))
    if len(routing.per_router()) > MAX_ROUTERS:
        out.append(f"... {len(routing.per_router()) - MAX_ROUTERS} more routers (--format json)")
    for b in routing.blame:
        if b.best is not None:
            e, n, mine, others = next(x for x in b.per_expert if x[0] == b.best)
            out.append(f"expert {b.best} of {b.module}: its {n} tokens carry mean rel error "
                       f"{mine:.3g}, the others {others:.3g}")
    return out


def routing_json(routing: RoutingResult | None) -> dict | None:
    return routing.as_dict() if routing is not None else None
