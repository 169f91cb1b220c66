"""The peer gate (accucheck.verdict.locate.peer_gate): without a control or a golden referee,
the first record over tolerance that introduces error is named only when it introduces more
than PEER_GATE x what its peers do. DiffResults built record by record, no files: each case
is one where the rule without the gate (name the first introduced record over tolerance)
answers otherwise."""
from __future__ import annotations

import dataclasses
import math

import pytest

from accucheck.compare.metrics import TensorMetrics
from accucheck.compare.results import DiffResult, GoldenLabel, RecordDiff, StatsDelta
from accucheck.compare.tolerances import PEER_GATE, Tolerance
from accucheck.keys import RecordKey
from accucheck.report.diff import render, to_json, verdict_line
from accucheck.verdict.locate import Analysis, locate

TOL = 5e-2
FED = 0.01  # the error every norm's input (the previous layer's down_proj) carries


def _m(err: float) -> TensorMetrics:
    return TensorMetrics(numel=8, max_abs=err, mean_abs=err, max_rel=err, rel_l2=err,
                         cosine=1.0, sqnr_db=0.0, rmse=err, max_ulp=None, ulp_dtype=None,
                         frac_rel_lt_1e3=1.0, frac_rel_lt_5e3=1.0, nan_inf_mismatch=0,
                         worst_index=None, worst_ref=None, worst_cand=None)


def _chain(norm_local: dict, *, layers: int = 10, quiet: float = 0.02, requests: int = 1,
           steps: int = 1, golden: bool = False) -> Analysis:
    """`requests` requests, `steps` steps each, through `layers` layers: an embedding record,
    then per layer a norm fed by the previous record (error FED) that adds its local error
    (`norm_local` by (req, step, layer), else (req, layer), else layer, else `quiet`), then a
    down_proj fed by the norm whose output error is FED again (the residual stream's scale
    dwarfs the norm's). With `golden`, a referee marks every record over tolerance "cand
    worse"."""
    recs = []

    def add(module: str, err: float, src: RecordKey | None) -> RecordKey:
        key = RecordKey(req, step, module, 0, "out", "0")
        label = None
        if golden:
            label = GoldenLabel("cand worse" if err > TOL else "both within noise", 1e-4, err, 3.0)
        recs.append(RecordDiff(
            key=key, kind="module", order=len(recs), ref_dtype="bfloat16",
            cand_dtype="bfloat16", ref_shape=(1, 8), cand_shape=(1, 8),
            tolerance=Tolerance(TOL), basis="tensor", metrics=_m(err), golden=label,
            src=(("0", str(src)),) if src is not None else ()))
        return key

    for req in range(requests):
        for step in range(steps):
            prev = add("model.embed_tokens", FED, None)
            for layer in range(layers):
                local = norm_local.get((req, step, layer), norm_local.get(
                    (req, layer), norm_local.get(layer, quiet)))
                norm = add(f"model.layers.{layer}.post_attention_layernorm", FED + local, prev)
                prev = add(f"model.layers.{layer}.mlp.down_proj", FED, norm)
    d = DiffResult("ref.h5", "cand.h5", "golden.h5" if golden else None, tuple(recs), (), (),
                   None, (), (), 0, ())
    return Analysis(d, locate(d))


def test_norms_that_all_add_bf16_noise_over_tolerance_name_no_culprit():
    """Every norm adds about the same local error (0.045-0.05, over the tolerance with what
    feeds it, x5.5-6 its input: each is "introduced"): rounding noise at this dtype, the
    regime of a bf16 run of a deep model. Without the gate, layer 0's norm is the culprit."""
    a = _chain({layer: 0.045 + 0.005 * (layer % 2) for layer in range(10)})
    L = a.location
    # over the tolerance, introduced nowhere above its peers: accumulated rounding, a PASS
    # that says so (it was a FAIL: every clean bf16 pair of a deep model failed)
    assert a.exit_code == 0 and a.accumulated and L.first_over is not None
    assert L.first_divergence is None and a.culprit is None and L.diffuse
    n = L.noise_like
    assert n is not None and n.key.module == "model.layers.0.post_attention_layernorm"
    assert n.peers == 4 and 0.8 < n.ratio < 1.2  # layers 1-4, within the window
    line = verdict_line(a)
    assert line.startswith("PASS: nothing introduces more than rounding noise: ")
    assert "introduces 0.9" in line or "introduces 1" in line  # the site's ratio to its peers
    assert "CULPRIT" not in render(a) and "--control-for REF" in line
    assert to_json(a)["culprit"] is None
    assert to_json(a)["noise_like"]["key"] == \
        "r0.s0:model.layers.0.post_attention_layernorm#0:out.0"
    assert to_json(a)["noise_like"]["gate"] == n.gate == PEER_GATE == 5.5


def test_a_norm_that_stands_out_from_its_peers_is_named():
    """Layer 5's norm adds x7 what the others do (0.14 against 0.02): named, as without the
    gate."""
    a = _chain({5: 0.14})
    assert a.location.noise_like is None
    assert a.culprit is not None and a.culprit.module == "model.layers.5.post_attention_layernorm"


def test_the_gate_sits_at_its_factor():
    """Just over PEER_GATE x the peers' median: named; just under: noise-like (no culprit).
    A record adds more than 0.04 on top of FED to be over tolerance: the peers add 0.016 each
    here, so that both sides of the gate are over tolerance."""
    quiet = 0.016
    over = _chain({5: quiet * PEER_GATE * 1.05}, quiet=quiet)
    under = _chain({5: quiet * PEER_GATE * 0.95}, quiet=quiet)
    assert over.culprit is not None and over.culprit.module.startswith("model.layers.5.")
    assert under.culprit is None and under.location.noise_like.key.module.startswith(
        "model.layers.5.")


def test_no_gate_with_a_golden_referee_or_without_enough_peers():
    """A golden referee judges who is worse: it decides, not the peers. Two layers leave each
    norm one peer: too few to say what noise is, so the first introduced record is named."""
    uniform = {layer: 0.048 for layer in range(10)}
    refereed = _chain(uniform, golden=True)
    assert refereed.location.noise_like is None and refereed.culprit is not None
    short = _chain({0: 0.048, 1: 0.048}, layers=2)
    assert short.location.noise_like is None and short.culprit is not None


def test_a_site_is_judged_over_every_request_not_by_its_first_record():
    """Three requests. A norm whose record in request 0 alone adds x6 its peers' error (one
    record's rounding, quiet in the other requests) is noise-like; a norm that adds x3.4 in
    request 0 (the first record over tolerance, under the gate on its own) and x6 in requests
    1 and 2 (a kernel fault shows in every call) is named."""
    sporadic = _chain({(0, 5): 0.12}, requests=3)
    assert sporadic.culprit is None
    assert sporadic.location.noise_like.key.module == "model.layers.5.post_attention_layernorm"
    assert sporadic.location.noise_like.records == 3
    fault = _chain({(0, 5): 0.068, (1, 5): 0.12, (2, 5): 0.12}, requests=3)
    assert fault.location.noise_like is None
    assert fault.culprit is not None and fault.culprit.module == \
        "model.layers.5.post_attention_layernorm" and fault.location.first_divergence.key.req == 0


def test_peers_that_introduce_nothing_make_no_infinite_ratio():
    """Peers whose local error is 0 (containers their children explain) are floored at the
    noise floor's smallest judged local error (5 % of the tolerance): layer 5's norm over
    tolerance in request 0 (x18 the floor), a little error in requests 1 and 2 (x4.8) and none
    in request 3 has a median of x4.8: noise-like. Unfloored, three of its four ratios would
    be infinite and the site a culprit."""
    a = _chain({(0, 5): 0.045, (1, 5): 0.012, (2, 5): 0.012}, quiet=0.0, requests=4)
    n = a.location.noise_like
    assert a.culprit is None and n is not None and n.records == 4
    assert 4.0 < n.ratio < 5.0


def test_a_site_that_stands_out_at_decode_is_named_though_its_prefill_peers_are_raised():
    """Two requests, prefill and two decode steps. Layer 5's norm adds 0.1 everywhere (a
    fault); at the prefill the layers after it are raised by its consequences (0.05 each
    against 0.01 before it: x3.3 its peers' median there), at the decode steps they are not
    (x10). The decode records decide: named. Judged by its prefill records alone (the phase of
    the first record over tolerance), it would be noise-like."""
    local = {}
    for req in (0, 1):
        for step in (0, 1, 2):
            local[(req, step, 5)] = 0.1
            for layer in range(6, 10):
                local[(req, step, layer)] = 0.05 if step == 0 else 0.01
            for layer in range(5):
                local[(req, step, layer)] = 0.01
    a = _chain(local, requests=2, steps=3)
    assert a.location.noise_like is None
    assert a.culprit is not None and a.culprit.module == "model.layers.5.post_attention_layernorm"
    assert a.location.first_divergence.key.step == 0



def test_a_site_that_stands_out_in_one_request_only_is_not_named():
    """Two requests, prefill and two decode steps. Layer 5's norm adds x20 its peers' error
    at both decode steps of request 0 and nothing more than they do anywhere else: what one
    token's attention core did between two correct bf16 devices on SmolLM2 (x19 and x36 in one
    request, x1.3 and x0.4 in the other; docs/control.md). Per request, the lower median:
    noise-like. The median over the phase's four records (x10.5, the rule before) named it.
    The same site at x7 in both requests' decode records is named, and at x20 in one request's
    prefill (a prompt served in part from the prefix cache meets a fault alone there)."""
    one = {(0, 1, 5): 0.4, (0, 2, 5): 0.4}
    a = _chain(one, requests=2, steps=3)
    n = a.location.noise_like
    assert a.culprit is None and a.exit_code == 0
    assert n is not None and n.key.module == "model.layers.5.post_attention_layernorm"
    assert n.ratio < 1.5 and n.records == 6 and n.gate == PEER_GATE
    both = _chain({**one, (1, 1, 5): 0.14, (1, 2, 5): 0.14}, requests=2, steps=3)
    assert both.location.noise_like is None
    assert both.culprit is not None and \
        both.culprit.module == "model.layers.5.post_attention_layernorm"
    assert both.location.first_divergence.key.step == 1
    prefill = _chain({(1, 0, 5): 0.4}, requests=2, steps=3)
    assert prefill.location.noise_like is None
    assert prefill.culprit is not None and \
        prefill.culprit.module == "model.layers.5.post_attention_layernorm"
    assert prefill.location.first_divergence.key.req == 1

def _sampled(bound_at_5: float) -> Analysis:
    """The stats store: two requests through 10 layers of norm -> down_proj, every record an
    estimate (basis "sample": rel_l2 from 64 sampled values, and a rigorous lower bound from
    statistics at half of it). Layer 5's norm is at 0.08 by its sample, x8 what feeds it, in
    both requests; its lower bound is `bound_at_5` x what feeds it."""
    recs = []

    def add(req: int, module: str, err: float, bound: float, src: RecordKey | None):
        key = RecordKey(req, 0, module, 0, "out", "0")
        recs.append(RecordDiff(
            key=key, kind="module", order=len(recs), ref_dtype="bfloat16",
            cand_dtype="bfloat16", ref_shape=(1, 8), cand_shape=(1, 8),
            tolerance=Tolerance(TOL), basis="sample", metrics=_m(err),
            stats=StatsDelta(False, bound, "l2", 0),
            src=(("0", str(src)),) if src is not None else ()))
        return key

    for req in (0, 1):
        prev = add(req, "model.embed_tokens", FED, FED / 2, None)
        for layer in range(10):
            err, bound = (0.08, bound_at_5 * FED) if layer == 5 else (FED, FED / 2)
            norm = add(req, f"model.layers.{layer}.post_attention_layernorm", err, bound, prev)
            prev = add(req, f"model.layers.{layer}.mlp.down_proj", FED, FED / 2, norm)
    d = DiffResult("ref.h5", "cand.h5", None, tuple(recs), (), (), None, (), (), 0, ())
    return Analysis(d, locate(d))


def test_a_site_that_stands_out_in_sampled_estimates_only_is_not_named():
    """64 fixed sampled positions miss an input error concentrated in a few channels, in
    every record, while the Linear after it spreads the error over all its outputs: between
    two correct bf16 runs of SmolLM2 (stats store), layer 15's o_proj output stood at x4 its
    sampled input in all six records, at x0.3-x0.7 by its rigorous bound, and was named.
    A site that stands out by its estimates is named only when its bound also exceeds what
    feeds it."""
    a = _sampled(bound_at_5=0.5)
    assert a.culprit is None and a.exit_code == 0, a.location.first_divergence
    n = a.location.noise_like
    assert n.bounded and n.key.module == "model.layers.5.post_attention_layernorm"
    assert n.ratio == 0.5 and "sampled estimates only" in verdict_line(a)
    assert to_json(a)["noise_like"]["bounded"] is True
    a = _sampled(bound_at_5=3.0)
    assert a.culprit is not None and a.culprit.module == "model.layers.5.post_attention_layernorm"
    assert a.exit_code == 1


def _residual(out_norm: float) -> Analysis:
    """One decoder layer fed by the embedding (rel_l2 0.01 of a norm-10 tensor), its
    self_attn and mlp outputs at rel_l2 0.02 (norms 5 and 9), and its output (input +
    attention + MLP, made by the layer's own code) at rel_l2 0.3 of a reference of norm
    `out_norm`. Absolute errors: 0.1 + 0.1 + 0.18 reach the output at most."""
    recs = []

    def add(module: str, rel: float, norm: float, src: RecordKey | None) -> RecordKey:
        key = RecordKey(0, 0, module, 0, "out", "0")
        m = dataclasses.replace(_m(rel), rmse=rel * norm / math.sqrt(8))
        recs.append(RecordDiff(
            key=key, kind="module", order=len(recs), ref_dtype="bfloat16",
            cand_dtype="bfloat16", ref_shape=(1, 8), cand_shape=(1, 8),
            tolerance=Tolerance(TOL), basis="tensor", metrics=m,
            src=(("0", str(src)),) if src is not None else ()))
        return key

    emb = add("model.embed_tokens", 0.01, 10.0, None)
    add("model.layers.0.self_attn", 0.02, 5.0, emb)
    add("model.layers.0.mlp", 0.02, 9.0, emb)
    add("model.layers.0", 0.3, out_norm, emb)
    d = DiffResult("ref.h5", "cand.h5", None, tuple(recs), (), (), None, (), (), 0, ())
    return Analysis(d, locate(d))


def test_a_residual_sum_that_cancels_passes_on_its_addends_absolute_error():
    """A late layer's MLP cancels the massive activation its input carries: the layer's output
    is small, and its relative error several times every addend's (between two correct bf16
    runs of SmolLM2, layer 28's output at x4.6 its input and its children, named). What a
    container's own code passes on is the sum of its feeders' absolute errors: 0.38 against
    an output of norm 1 explains rel_l2 0.3. The same rel_l2 of a norm-10 output does not."""
    a = _residual(out_norm=1.0)
    loc = next(x for x in a.location.records if x.key.module == "model.layers.0")
    assert loc.cause == "inherited" and loc.explained == pytest.approx(0.38)
    assert a.culprit is None and a.exit_code == 0
    a = _residual(out_norm=10.0)
    assert a.culprit is not None and a.culprit.module == "model.layers.0"
