"""The verdict rules on synthetic captures built so that the right rule and a plausible wrong one
give different answers: an introduced fault behind an earlier inherited record, two introduced
records, steps and requests interleaved, the KV-cache carry, a wrong residual add, producer
links vs the residual proxy, precision findings, the golden referee, the noise floor. Each
asserts the exact record / label / exit code."""
from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from accucheck.compare.tolerances import ToleranceTable
from accucheck.verdict.culprit import culprit_lines, find_culprit
from accucheck.keys import RecordKey
from accucheck.verdict.locate import analyze, peer_kind
from accucheck.report.diff import render, to_json, verdict_line
from accucheck.store import CaptureWriter
from accucheck.compare.tolerances import (DEFAULT_AMPLIFICATION, NOISE_FLOOR_FACTOR,
                                          NOISE_FLOOR_MIN_FRACTION)

H = 64
_RUNS = itertools.count()


def _stats(x):
    f = x.astype(np.float64).ravel()
    return np.array([f.min(), f.max(), f.mean(), f.std(), np.abs(f).max(), np.sqrt(f @ f),
                     0, 0, (f == 0).sum(), f.size], dtype=np.float64)


def cap(path, recs, *, dtype="float32", gen=((4, 5),), prompts=((1, 2, 3),), meta=None):
    """recs: [(key, array, extra-dict-or-None, record-dtype-or-None)] in execution order."""
    with CaptureWriter(path, meta={"dtype": dtype, **(meta or {})}, store="full") as w:
        for k, x, extra, rdt in recs:
            key = RecordKey.parse(k)
            x = np.asarray(x, np.float16 if rdt == "float16" else np.float32)
            kind = "logits" if key.is_logits else ("op" if key.is_op else "module")
            bits = x.view(np.uint16 if x.itemsize == 2 else np.uint32).astype(np.int64)
            w.add(key, kind, rdt or "float32", x.shape, _stats(x), int(bits.sum() % 2 ** 52), x,
                  json.dumps(extra) if extra else "")
        for i, (p, g) in enumerate(zip(prompts, gen)):
            w.set_request(i, p, g)
    return path


class Run:
    """A reference and a candidate built record by record; `err` sets the candidate's rel_l2."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.ref, self.cand = [], []

    def add(self, key, err=0.0, src=None, cand_dtype=None, shape=(1, 3, H)):
        x = self.rng.standard_normal(shape)
        if err:
            n = self.rng.standard_normal(shape)
            y = x + n * err * np.linalg.norm(x) / np.linalg.norm(n)
        else:
            y = x
        extra = {"src": src} if src else None
        self.ref.append((key, x, extra, None))
        self.cand.append((key, y, extra, cand_dtype))
        return self

    def analyze(self, tmp_path, golden=None, **kw):
        tmp_path = tmp_path / f"a{next(_RUNS)}"
        tmp_path.mkdir()
        steps = {RecordKey.parse(k).step for k, *_ in self.ref}
        reqs = {RecordKey.parse(k).req for k, *_ in self.ref}
        gen = tuple(tuple(range(4, 4 + max(steps) + 1)) for _ in reqs)
        prompts = tuple((1, 2, 3) for _ in reqs)
        r = cap(tmp_path / "ref.h5", self.ref, gen=gen, prompts=prompts)
        c = cap(tmp_path / "cand.h5", self.cand, gen=gen, prompts=prompts,
                dtype=kw.pop("cand_run_dtype", "float32"))
        g = None
        if golden is not None:
            g = cap(tmp_path / "gold.h5", [(k, golden.get(k, x), None, None)
                                          for k, x, _, _ in self.ref], gen=gen, prompts=prompts)
        return analyze(r, c, g, **kw)


def layer(run, req, step, i, errs=None, links=True):
    """A Llama-like layer: norm -> attn -> norm(in: residual sum) -> mlp -> layer out."""
    e = dict(errs or {})
    p = f"r{req}.s{step}:model.layers.{i}"
    prev = f"model.layers.{i - 1}#0:out.0" if i else "model.embed_tokens#0:out.0"
    run.add(f"{p}.input_layernorm#0:out.0", e.get("input_layernorm", 0.0),
            {"0": prev} if links else None)
    run.add(f"{p}.self_attn#0:out.0", e.get("self_attn", 0.0),
            {"hidden_states": f"model.layers.{i}.input_layernorm#0:out.0"} if links else None)
    run.add(f"{p}.post_attention_layernorm#0:in.0", e.get("post_in", 0.0))
    run.add(f"{p}.post_attention_layernorm#0:out.0", e.get("post_attention_layernorm", 0.0))
    run.add(f"{p}.mlp#0:out.0", e.get("mlp", 0.0),
            {"0": f"model.layers.{i}.post_attention_layernorm#0:out.0"} if links else None)
    run.add(f"{p}#0:out.0", e.get("layer", 0.0), {"0": prev} if links else None)


def model_run(run, req=0, step=0, layers=4, faults=None, links=True):
    run.add(f"r{req}.s{step}:model.embed_tokens#0:out.0")
    for i in range(layers):
        layer(run, req, step, i, (faults or {}).get(i), links)


# ----------------------------------------------------------------- first divergence

def test_first_introduced_wins_over_an_earlier_inherited_record(tmp_path):
    """Layer 0's mlp adds an error within tolerance; layer 1's residual sum carries 2.5x of it,
    over tolerance but inherited; layer 3's mlp introduces. The first over-tolerance record is
    NOT the culprit."""
    run = Run()
    model_run(run, faults={0: {"mlp": 4e-5, "layer": 4e-5},
                           1: {"post_in": 1e-4, "post_attention_layernorm": 1.2e-4,
                               "mlp": 1.1e-4, "layer": 1e-4},
                           2: {"input_layernorm": 1e-4, "self_attn": 1e-4, "post_in": 1e-4,
                               "post_attention_layernorm": 1e-4, "mlp": 1e-4, "layer": 1e-4},
                           3: {"input_layernorm": 1e-4, "self_attn": 1e-4, "post_in": 1e-4,
                               "post_attention_layernorm": 1e-4, "mlp": 2e-2, "layer": 2e-2}})
    a = run.analyze(tmp_path)
    L = a.location
    assert str(L.first_over.key) == "r0.s0:model.layers.1.post_attention_layernorm#0:in.0"
    assert L.first_over.cause == "inherited"
    assert str(L.first_divergence.key) == "r0.s0:model.layers.3.mlp#0:out.0"
    assert L.first_divergence.input_basis == "links"
    assert a.culprit.where == "model.layers.3.mlp#0" and a.exit_code == 1


def test_the_first_introduced_not_the_largest(tmp_path):
    run = Run()
    model_run(run, faults={1: {"mlp": 1e-3, "layer": 1e-3},
                           2: {"input_layernorm": 1e-3, "self_attn": 1e-3, "post_in": 1e-3,
                               "post_attention_layernorm": 1e-3, "mlp": 1e-1, "layer": 1e-1}})
    a = run.analyze(tmp_path)
    assert str(a.location.first_divergence.key) == "r0.s0:model.layers.1.mlp#0:out.0"
    assert a.location.top[0].key.module == "model.layers.2.mlp"  # the largest is ranked first
    assert a.culprit.where == "model.layers.1.mlp#0"


def test_default_amplification_is_four(tmp_path):
    """An output 6x its input error is introduced at the default (4), not at 10 (the residual
    sum before it carries 2.5x the attention's error, under tolerance: inherited at both)."""
    run = Run()
    model_run(run, layers=2, faults={0: {"self_attn": 4e-5, "post_in": 1e-4, "post_attention_layernorm": 6e-4,
                                         "mlp": 6e-4, "layer": 6e-4},
                                     1: {k: 6e-4 for k in ("input_layernorm", "self_attn",
                                                           "post_in",
                                                           "post_attention_layernorm", "mlp",
                                                           "layer")}})
    a = run.analyze(tmp_path)
    assert DEFAULT_AMPLIFICATION == 4.0
    assert a.location.first_divergence.key.module == "model.layers.0.post_attention_layernorm"
    assert run.analyze(tmp_path, amplification=10.0).location.first_divergence is None


def test_earliest_step_first_then_request(tmp_path):
    """Request 1 step 0 comes before request 0 step 1 (walk: step, then request)."""
    run = Run()
    model_run(run, req=0, step=0, layers=2)
    model_run(run, req=1, step=0, layers=2, faults={1: {"mlp": 1e-2, "layer": 1e-2}})
    run.add("r0.s1:model.embed_tokens#0:out.0", shape=(1, 1, H))
    run.add("r0.s1:model.layers.0.mlp#0:out.0", 1e-2, shape=(1, 1, H),
            src={"0": "model.embed_tokens#0:out.0"})
    a = run.analyze(tmp_path)
    fd = a.location.first_divergence
    assert (fd.key.req, fd.step, fd.key.module) == (1, 0, "model.layers.1.mlp")
    assert verdict_line(a).startswith("FAIL: divergence starts at step 0, request 1, "
                                      "model.layers.1.mlp (out.0)")


def test_kv_cache_carry_makes_a_decode_step_inherited(tmp_path):
    """Step 0: what feeds the attention is off by 3e-5 (under tolerance), and so is the
    attention; step 1: the attention is over (1e-4) with an exact input. The cache holds what
    fed step 0: inherited (1e-4 < 4 x 3e-5), no culprit."""
    run = Run()
    for step, (e_in, e_out) in ((0, (3e-5, 3e-5)), (1, (0.0, 1e-4))):
        n = 3 if step == 0 else 1
        run.add(f"r0.s{step}:model.embed_tokens#0:out.0", e_in, shape=(1, n, H))
        run.add(f"r0.s{step}:model.layers.0.self_attn#0:out.0", e_out, shape=(1, n, H),
                src={"hidden_states": "model.embed_tokens#0:out.0"})
    a = run.analyze(tmp_path)
    x = next(x for x in a.location.records if str(x.key) == "r0.s1:model.layers.0.self_attn#0:out.0")
    assert x.input_error == pytest.approx(3e-5, rel=1e-3) and x.cause == "inherited"
    assert x.input_from == ("r0.s0:model.embed_tokens#0:out.0",)
    assert a.location.first_divergence is None and a.location.diffuse and a.culprit is None


def test_a_module_s_own_earlier_error_does_not_explain_its_error_now(tmp_path):
    """A stateless module with exact inputs at both steps, 3e-5 at step 0 (under tolerance),
    1e-4 at step 1: its own earlier output feeds nothing; it introduces the error at step 1."""
    run = Run()
    for step, err in ((0, 3e-5), (1, 1e-4)):
        n = 3 if step == 0 else 1
        run.add(f"r0.s{step}:model.embed_tokens#0:out.0", shape=(1, n, H))
        run.add(f"r0.s{step}:model.layers.0.mlp#0:out.0", err, shape=(1, n, H),
                src={"0": "model.embed_tokens#0:out.0"})
    a = run.analyze(tmp_path)
    fd = a.location.first_divergence
    assert (str(fd.key), fd.cause) == ("r0.s1:model.layers.0.mlp#0:out.0", "introduced")
    assert a.culprit.where == "model.layers.0.mlp#0" and a.culprit.step == 1


def test_a_wrong_residual_add_blames_the_container(tmp_path):
    run = Run()
    model_run(run, layers=2, faults={0: {"layer": 1e-3},
                                     1: {k: 1e-3 for k in ("input_layernorm", "self_attn",
                                                           "post_in",
                                                           "post_attention_layernorm", "mlp",
                                                           "layer")}})
    a = run.analyze(tmp_path)
    fd = a.location.first_divergence
    assert str(fd.key) == "r0.s0:model.layers.0#0:out.0" and fd.inner_error == 0.0


def test_links_beat_the_residual_proxy(tmp_path):
    """A parallel block (attention and MLP both read the norm's output, GPT-J style): the MLP's
    producer is the exact norm, not the attention recorded just before it. With links the MLP
    is introduced (2e-3 over an exact input); the proxy (previous record: the attention, 1e-3)
    would call it inherited."""
    def build(links):
        run = Run()
        run.add("r0.s0:model.embed_tokens#0:out.0")
        run.add("r0.s0:model.layers.0.ln#0:out.0",
                src={"0": "model.embed_tokens#0:out.0"} if links else None)
        run.add("r0.s0:model.layers.0.attn#0:out.0", 1e-3,
                src={"0": "model.layers.0.ln#0:out.0"} if links else None)
        run.add("r0.s0:model.layers.0.mlp#0:out.0", 2e-3,
                src={"0": "model.layers.0.ln#0:out.0"} if links else None)
        return run.analyze(tmp_path / ("l" if links else "p"))
    (tmp_path / "l").mkdir()
    (tmp_path / "p").mkdir()
    mlp = "r0.s0:model.layers.0.mlp#0:out.0"
    linked = {str(x.key): x for x in build(True).location.records}[mlp]
    proxied = {str(x.key): x for x in build(False).location.records}[mlp]
    assert (linked.cause, linked.input_basis, linked.input_error) == ("introduced", "links", 0.0)
    assert linked.input_from == ("r0.s0:model.layers.0.ln#0:out.0",)
    assert (proxied.cause, proxied.input_basis) == ("inherited", "proxy")
    assert proxied.input_error == pytest.approx(1e-3, rel=1e-3)


def test_proxy_is_the_immediately_preceding_record_not_the_worst(tmp_path):
    """No links (graph-mode capture): layer 2's norm input is layer 1 (exact), although layer 0
    carried an inherited error earlier: the norm fault is introduced."""
    run = Run()
    run.add("r0.s0:model.embed_tokens#0:out.0")
    run.add("r0.s0:model.layers.0#0:out.0", 2e-3)       # over tolerance, nothing feeds it
    run.add("r0.s0:model.layers.1#0:out.0", 1e-6)       # the error died out
    run.add("r0.s0:model.layers.2.input_layernorm#0:out.0", 2e-3)
    run.add("r0.s0:model.layers.2#0:out.0", 2e-3)
    a = run.analyze(tmp_path)
    locs = {str(x.key): x for x in a.location.records}
    n = locs["r0.s0:model.layers.2.input_layernorm#0:out.0"]
    assert n.input_basis == "proxy" and n.input_error == pytest.approx(1e-6, rel=1e-3)
    assert n.cause == "introduced"
    assert str(a.location.first_divergence.key) == "r0.s0:model.layers.0#0:out.0"


# ----------------------------------------------------------------- precision, referee

def test_record_computed_in_float16_is_judged_at_float32_and_reported(tmp_path):
    run = Run()
    run.add("r0.s0:model.embed_tokens#0:out.0")
    run.add("r0.s0:model.layers.0.self_attn#0/aten.bmm.default@0:out.0",
            src={"0": "model.embed_tokens#0:out.0"})
    run.add("r0.s0:model.layers.0.self_attn#0/aten._softmax.default@1:out.0", 4e-4,
            cand_dtype="float16", src={"0": "model.layers.0.self_attn#0/aten.bmm.default@0:out.0"})
    run.add("r0.s0:model.layers.0.self_attn#0/aten.bmm.default@2:out.0", 4e-4,
            src={"0": "model.layers.0.self_attn#0/aten._softmax.default@1:out.0"})
    run.add("r0.s0:model.layers.0.self_attn#0:out.0", 4e-4,
            src={"hidden_states": "model.embed_tokens#0:out.0"})
    a = run.analyze(tmp_path)
    sm = next(r for r in a.diff.records if r.key.op == "aten._softmax.default")
    assert sm.tolerance.rel_l2 == 5e-5 and not sm.within   # float16's 1e-2 would pass it
    assert [r.key.op for r in a.diff.precision_findings] == ["aten._softmax.default"]
    c = a.culprit
    assert c.op == "aten._softmax.default" and c.precision.startswith(
        "candidate computes aten._softmax.default in float16, reference in float32")
    assert a.location.first_divergence.key == c.op_key
    assert "PRECISION: r0.s0:model.layers.0.self_attn#0/aten._softmax.default@1:out.0" in render(a)


def test_whole_run_dtype_difference_sets_the_tolerance_not_a_finding(tmp_path):
    run = Run()
    model_run(run, layers=1, faults={0: {"mlp": 1e-2, "layer": 1e-2}})
    a = run.analyze(tmp_path, cand_run_dtype="bfloat16")
    assert {r.tolerance.rel_l2 for r in a.diff.records if not r.key.is_logits} == {5e-2}
    assert a.diff.precision_findings == () and a.exit_code == 0


def test_golden_referee_decides_pass_and_culprit(tmp_path):
    """Both sides over tolerance vs each other at the mlp, but the golden finds the candidate
    no worse: pass. A candidate worse than the reference: fail there."""
    run = Run(1)
    model_run(run, layers=1, faults={0: {"mlp": 1e-3, "layer": 1e-3}})
    gold = {k: x for k, x, _, _ in run.ref}
    # golden halfway between ref and cand on the mlp: both within noise
    for k, x, _, _ in run.ref:
        y = next(c for kk, c, _, _ in run.cand if kk == k)
        gold[k] = (x + y) / 2
    a = run.analyze(tmp_path, golden=gold)
    mlp = next(r for r in a.diff.records if r.key.module == "model.layers.0.mlp")
    assert not mlp.within_tolerance and mlp.golden.label == "both within noise" and mlp.within
    assert a.exit_code == 0 and a.location.suspicious == ()
    assert "judged no worse than the reference by the golden referee" in verdict_line(a)
    gold2 = {k: x for k, x, _, _ in run.ref}  # golden == reference: the candidate is worse
    a2 = run.analyze(tmp_path, golden=gold2)
    assert a2.exit_code == 1 and a2.culprit.where == "model.layers.0.mlp#0"
    assert a2.culprit.golden == "cand worse"


# ----------------------------------------------------------------- noise floor, reporting

# bf16's tolerance on a float16 run: the noise-floor cases' 1e-3 input errors are a rounding or
# more in float16 (2^-11), as a deep bf16 run's are in bfloat16; in a bfloat16 run they would be
# under one rounding (2^-8), where nothing is said to amplify
BF16_LIKE = {"cand_run_dtype": "float16", "tolerances": ToleranceTable.from_options(rel_l2=5e-2)}


def test_noise_floor_names_the_outlier_within_tolerance(tmp_path):
    """bf16-like runs: every down_proj amplifies its input x1; one x20 (still under 5e-2)."""
    run = Run(2)
    run.add("r0.s0:model.embed_tokens#0:out.0", 1e-3)
    for i in range(8):
        prev = f"model.layers.{i - 1}#0:out.0" if i else "model.embed_tokens#0:out.0"
        e_in = 1e-3
        run.add(f"r0.s0:model.layers.{i}.mlp.down_proj#0:in.0", e_in)
        run.add(f"r0.s0:model.layers.{i}.mlp.down_proj#0:out.0", 2e-2 if i == 5 else 1e-3)
        run.add(f"r0.s0:model.layers.{i}#0:out.0", 1e-3, src={"0": prev})
    a = run.analyze(tmp_path, **BF16_LIKE)
    assert a.exit_code == 0  # within tolerance: a PASS that says SUSPICIOUS
    sus = a.location.suspicious
    assert [str(s.key) for s in sus] == ["r0.s0:model.layers.5.mlp.down_proj#0:out.0"]
    s = sus[0]
    assert s.gain == pytest.approx(20, rel=0.05) and s.peers == 6 and s.within  # layers 1-4, 6-7
    assert s.ratio > NOISE_FLOOR_FACTOR and s.local > NOISE_FLOOR_MIN_FRACTION * s.tolerance
    assert "SUSPICIOUS" in verdict_line(a) and to_json(a)["suspicious"][0]["key"] == str(s.key)
    # x4 above its peers is not enough (the factor is 5)
    run2 = Run(2)
    run2.add("r0.s0:model.embed_tokens#0:out.0", 1e-3)
    for i in range(8):
        run2.add(f"r0.s0:model.layers.{i}.mlp.down_proj#0:in.0", 1e-3)
        run2.add(f"r0.s0:model.layers.{i}.mlp.down_proj#0:out.0", 6e-3 if i == 5 else 1.5e-3)
    assert run2.analyze(tmp_path, **BF16_LIKE).location.suspicious == ()


def test_diffuse_error_prints_no_culprit(tmp_path):
    """The embedding is a little off (within tolerance), every layer grows it less than 4x:
    over tolerance from layer 0 on, introduced nowhere."""
    run = Run()
    run.add("r0.s0:model.embed_tokens#0:out.0", 3e-5)
    for i, e in enumerate((1e-4, 2e-4, 3e-4)):
        run.add(f"r0.s0:model.layers.{i}#0:out.0", e,
                src={"0": f"model.layers.{i - 1}#0:out.0" if i else "model.embed_tokens#0:out.0"})
    a = run.analyze(tmp_path)
    # no control, no golden: error that only accumulates is not a failure by itself
    assert a.exit_code == 0 and a.culprit is None and find_culprit(a) is None
    line = verdict_line(a)
    assert line.startswith("PASS: nothing introduces more than rounding noise: 3 of 4 records "
                           "over the default float32 tolerance carry error accumulated through "
                           "the model (diffuse / inherited); largest at step 0, model.layers.2 "
                           "(out.0): rel_l2 3.00e-04")
    assert "--control-for REF" in line
    # with a golden that finds the candidate worse, the same diffuse error fails
    gold = {k: 0.0 for k, *_ in run.ref}
    g = run.analyze(tmp_path, golden=gold)
    assert g.exit_code == 1 and g.culprit is None
    assert verdict_line(g).startswith("FAIL: 3 records over tolerance, but no record introduces "
                                      "the error (diffuse / inherited): first at step 0, "
                                      "model.layers.0 (out.0)")
    j = to_json(a)
    assert j["diffuse"] is True and j["first_divergence"] is None and j["culprit"] is None
    assert j["worst"]["module"] == "model.layers.2" and j["first_over"]["cause"] == "inherited"
    assert "CULPRIT" not in render(a) and "No culprit" in render(a)
    assert math.isclose(a.location.worst.error, 3e-4, rel_tol=1e-3)


def test_culprit_evidence_names_the_cast_next_to_the_downgraded_op(tmp_path):
    """The candidate casts to float16 around its softmax: the softmax is the culprit (root op,
    precision finding), the casts are one-sided neighbours with their call sites, the module
    and its submodule ops are counted."""
    rng = np.random.default_rng(5)
    base = "r0.s0:model.layers.0.self_attn"
    x = {n: rng.standard_normal((1, 3, H)) for n in ("emb", "q", "bmm", "sm", "out")}

    def rec(key, arr, src=None, site=None, dtype=None):
        e = {}
        if src:
            e["src"] = src
        if site:
            e["site"] = site
        return (key, arr, e or None, dtype)
    n = rng.standard_normal(x["sm"].shape)
    sm_err = x["sm"] + 1e-3 * np.linalg.norm(x["sm"]) * n / np.linalg.norm(n)
    common = [rec("r0.s0:model.embed_tokens#0:out.0", x["emb"]),
              rec(f"{base}.q_proj#0/aten.mm.default@0:out.0", x["q"],
                  {"0": "model.embed_tokens#0:out.0"}, "modeling.py:10 in forward"),
              rec(f"{base}.q_proj#0:out.0", x["q"], {"0": "model.embed_tokens#0:out.0"}),
              rec(f"{base}#0/aten.bmm.default@0:out.0", x["bmm"],
                  {"0": "model.layers.0.self_attn.q_proj#0:out.0"}, "modeling.py:20 in attn")]
    ref = common + [
        rec(f"{base}#0/aten._softmax.default@1:out.0", x["sm"],
            {"0": "model.layers.0.self_attn#0/aten.bmm.default@0:out.0"}, "modeling.py:21 in attn"),
        rec(f"{base}#0:out.0", x["out"], {"hidden_states": "model.embed_tokens#0:out.0"})]
    cand = common + [
        rec(f"{base}#0/aten._to_copy.default@1:out.0", x["bmm"], None, "patch.py:5 in attn",
            "float16"),
        rec(f"{base}#0/aten._softmax.default@2:out.0", sm_err,
            {"0": "model.layers.0.self_attn#0/aten._to_copy.default@1:out.0"},
            "patch.py:6 in attn", "float16"),
        rec(f"{base}#0/aten._to_copy.default@3:out.0", sm_err, None, "patch.py:7 in attn"),
        rec(f"{base}#0:out.0", x["out"] * 1.001, {"hidden_states": "model.embed_tokens#0:out.0"})]
    r, c = cap(tmp_path / "r.h5", ref), cap(tmp_path / "c.h5", cand)
    a = analyze(r, c)
    cu = a.culprit
    assert cu.where == "model.layers.0.self_attn#0 / aten._softmax.default@1"
    assert cu.cand_key is not None and cu.cand_key.op_index == 2
    assert (cu.local_basis, cu.inherited_error) == ("links", 0.0)
    assert cu.local_error == pytest.approx(cu.error) and cu.error == pytest.approx(1e-3, rel=0.05)
    assert cu.site_ref == "modeling.py:21 in attn" and cu.site_cand == "patch.py:6 in attn"
    assert cu.precision is not None and "float16" in cu.precision
    assert cu.neighbours == (
        "cand only: aten._to_copy.default@1 at patch.py:5 in attn",
        "cand only: aten._to_copy.default@3 at patch.py:7 in attn")
    assert cu.ops_one_sided == 2 and cu.ops_compared == 3  # bmm, softmax, and q_proj's mm
    assert cu.module_error == pytest.approx(1e-3, rel=1e-6) and cu.next_step is None
    text = "\n".join(culprit_lines(cu))
    assert "next to it, cand only: aten._to_copy.default@1 at patch.py:5 in attn" in text
    assert "call site: ref modeling.py:21 in attn | cand patch.py:6 in attn" in text


def test_module_culprit_without_ops_prints_the_narrowing_command(tmp_path):
    run = Run()
    model_run(run, layers=1, faults={0: {"mlp": 1e-2, "layer": 1e-2}})
    a = run.analyze(tmp_path)
    cu = a.culprit
    assert cu.op is None and cu.where == "model.layers.0.mlp#0"
    assert "--include 'model.layers.0.mlp' --level op" in cu.next_step
    assert "--shadow ref-op.h5" in cu.next_step
    assert "next, to name the operator" in render(a)
    assert cu.inherited_error == 0.0 and cu.local_basis == "links"
    assert cu.amplification == math.inf and not cu.local_within


def test_results_are_frozen_and_judge_themselves(tmp_path):
    """Per-item results are frozen records without truthiness (STYLE 2, 10); the top-level
    result says pass / fail explicitly."""
    import dataclasses

    run = Run()
    model_run(run, layers=2, faults={1: {"mlp": 1e-2, "layer": 1e-2}})
    a = run.analyze(tmp_path)
    L = a.location
    fd = L.first_divergence
    frozen = (a.diff.records[0], L.records[0], fd, L, a.diff, a, L.curve[0], a.culprit)
    for obj in frozen:
        assert dataclasses.is_dataclass(obj)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, dataclasses.fields(obj)[0].name, None)
    for obj in (a.diff.records[0], L.records[0], fd, L, a.diff, a.culprit):
        assert not hasattr(obj, "__bool__"), type(obj)  # ask `within` / `passed` explicitly
    assert (a.verdict, a.exit_code, bool(a)) == ("fail", 1, False)
    assert not L.diffuse and fd.amplification == math.inf
    j = to_json(a)
    assert j["first_divergence"]["amplification"] == "inf" and j["verdict"] == "fail"
    assert j["exit_code"] == 1 and j["diffuse"] is False
    ok = Run()
    model_run(ok, layers=1)
    b = ok.analyze(tmp_path)
    assert (b.verdict, b.exit_code, bool(b)) == ("pass", 0, True)
    assert not b.location.diffuse and b.location.first_over is None and b.culprit is None


def test_layer_curve_is_the_layer_blocks_first_output(tmp_path):
    run = Run()
    run.add("r0.s0:model.embed_tokens#0:out.0")
    run.add("r0.s0:model.layers.0.mlp#0:out.0", 1e-3)
    run.add("r0.s0:model.layers.0#0:out.0", 1e-3)
    run.add("r0.s0:model.layers.0#0:out.1", 1e-2)             # a second output: not the curve
    run.add("r0.s0:model.layers.1#0:out.hidden_states", 2e-3)
    run.add("r0.s0:model.layers.2#0:out.0.0", 3e-3)
    run.add("r0.s0:model.layers.3#0/aten.add.Tensor@0:out.0", 1e-3)  # an op: not the curve
    run.add("r0.s0:model.norm#0:out.0", 3e-3)
    a = run.analyze(tmp_path)
    pts = [(p.layer, str(p.key), round(p.rel_l2, 6), p.within) for p in a.location.curve]
    assert pts == [(0, "r0.s0:model.layers.0#0:out.0", 1e-3, False),
                   (1, "r0.s0:model.layers.1#0:out.hidden_states", 2e-3, False),
                   (2, "r0.s0:model.layers.2#0:out.0.0", 3e-3, False)]


def test_peer_kind_wildcards_every_numeric_path_component():
    k = RecordKey.parse("r1.s2:model.layers.12.mlp.experts.3.down_proj#0/aten.mm.default@4:in.1")
    assert peer_kind(k) == "model.layers.*.mlp.experts.*.down_proj#0/aten.mm.default@4:in.1"
    assert peer_kind(RecordKey.parse("r0.s0:h.7.attn#1:out.0")) == "h.*.attn#1:out.0"
    assert peer_kind(RecordKey.parse("r0.s0:model.norm2#0:out.0")) == "model.norm2#0:out.0"


def _down_projs(run, gains, *, req=0, step=0, e_in=1e-3, first=0, extra=None):
    """One down_proj per layer (first, first+1, ...) whose output error is gain x its input's."""
    n = 3 if step == 0 else 1
    for j, g in enumerate(gains):
        i = first + j
        p = f"r{req}.s{step}:model.layers.{i}.mlp.down_proj#0"
        run.add(f"{p}:in.0", e_in, shape=(1, n, H))
        run.add(f"{p}:out.0", g * e_in, shape=(1, n, H))


def _sus(run, tmp_path, **kw):
    a = run.analyze(tmp_path, **BF16_LIKE, **kw)
    return [str(s.key) for s in a.location.suspicious], a


def test_noise_floor_window_peers_and_thresholds(tmp_path):
    # peers farther than 4 layers away do not count: with only 2 peers nearby, not judged
    run = Run(3)
    run.add("r0.s0:model.embed_tokens#0:out.0", 1e-3)
    _down_projs(run, [1, 1, 20], first=0)
    _down_projs(run, [1, 1, 1, 1], first=10)
    assert _sus(run, tmp_path)[0] == []
    # 3 peers within the window: judged, and named
    run = Run(3)
    run.add("r0.s0:model.embed_tokens#0:out.0", 1e-3)
    _down_projs(run, [1, 1, 1, 20], first=0)
    names, a = _sus(run, tmp_path)
    assert names == ["r0.s0:model.layers.3.mlp.down_proj#0:out.0"]
    assert a.location.suspicious[0].peers == 3
    # a local error under 5 % of the tolerance is not judged (5e-2 * 0.05 = 2.5e-3)
    run = Run(3)
    run.add("r0.s0:model.embed_tokens#0:out.0", 1e-4)
    _down_projs(run, [1, 1, 1, 20], first=0, e_in=1e-4)   # local 1.9e-3
    assert _sus(run, tmp_path)[0] == []
    # the gain must also exceed the amplification (here raised to 30)
    run = Run(3)
    run.add("r0.s0:model.embed_tokens#0:out.0", 1e-3)
    _down_projs(run, [1, 1, 1, 20], first=0)
    assert _sus(run, tmp_path, amplification=30.0)[0] == []
    # peers whose median gain is 5: 20 is only 4x that
    run = Run(3)
    run.add("r0.s0:model.embed_tokens#0:out.0", 1e-3)
    _down_projs(run, [5, 5, 5, 20], first=0)
    assert _sus(run, tmp_path)[0] == []


def test_noise_floor_compares_within_request_and_step_and_sorts(tmp_path):
    run = Run(4)
    for req in (0, 1):
        run.add(f"r{req}.s0:model.embed_tokens#0:out.0", 1e-3)
        _down_projs(run, [1, 1, 1, 1, 20 if req == 1 else 1, 1], req=req)
    run.add("r0.s1:model.embed_tokens#0:out.0", 1e-3, shape=(1, 1, H))
    _down_projs(run, [1, 25, 1, 1], req=0, step=1)
    names, a = _sus(run, tmp_path)
    assert names == ["r1.s0:model.layers.4.mlp.down_proj#0:out.0",
                     "r0.s1:model.layers.1.mlp.down_proj#0:out.0"]
    s = a.location.suspicious[0]
    assert s.kind == "model.layers.*.mlp.down_proj#0:out.0" and s.peers == 5  # layers 0-3, 5
    assert s.peers_median == pytest.approx(1.0, rel=1e-3)
    assert s.ratio == pytest.approx(s.gain / s.peers_median, rel=1e-12)


def test_noise_floor_judges_the_site_over_its_requests(tmp_path):
    """Three requests. One token's rounding: layer 4's down_proj amplifies x20 in request 1
    alone (x1 in requests 0 and 2): an outlier record, not an outlier site: not suspicious.
    A kernel's defect: x20 in every request: suspicious in each."""
    def run_with(gains_by_req):
        run = Run(6)
        for req, g in enumerate(gains_by_req):
            run.add(f"r{req}.s0:model.embed_tokens#0:out.0", 1e-3)
            _down_projs(run, [1, 1, 1, 1, g, 1], req=req)
        return _sus(run, tmp_path)[0]

    assert run_with([1, 20, 1]) == []
    assert run_with([20, 20, 20]) == [f"r{q}.s0:model.layers.4.mlp.down_proj#0:out.0"
                                      for q in range(3)]


def test_noise_floor_leaves_out_what_follows_the_first_divergence(tmp_path):
    run = Run(5)
    run.add("r0.s0:model.embed_tokens#0:out.0", 1e-3)
    _down_projs(run, [1, 1, 1, 20, 1, 1, 1, 1], first=0)
    run.add("r0.s0:model.layers.9.mlp#0:out.0", 0.2, src={"0": "model.embed_tokens#0:out.0"})
    _down_projs(run, [1, 1, 1, 20, 1, 1, 1], first=10)
    names, a = _sus(run, tmp_path)
    assert str(a.location.first_divergence.key) == "r0.s0:model.layers.9.mlp#0:out.0"
    assert names == ["r0.s0:model.layers.3.mlp.down_proj#0:out.0"]  # not layer 13's
