"""The built-in tiny model: a Llama-style causal LM and a BPE tokenizer, built offline.

Deterministic from a seed: the same seed gives bit-identical weights and tokenizer on any
machine, so `accucheck tiny-model DIR` on a GPU box and on an NPU box yields the same model.
Imports torch, transformers and tokenizers lazily.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

# Same size as the reference measurements in the issues: hidden 256, 4 layers (~3M parameters).
TINY_CONFIG = dict(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.08,
)

CORPUS = """\
The quick brown fox jumps over the lazy dog while the numbers on the accelerator drift.
Accuracy of large language models depends on every layer: embeddings, attention, the MLP,
normalization and the final projection to the vocabulary. A port to a new device is correct
when the same prompt gives the same tokens and the same logits within the noise of the dtype.
Greedy decoding picks the most likely token at each step; a near tie can flip on rounding.
Teams compare eager mode with graph mode, one release with the next, one device with another.
Tensor statistics, relative error, cosine similarity and the signal to noise ratio tell how far
two runs are apart, and the first layer where they part ways tells where to look for the fault.
"""


def default_cache_dir() -> Path:
    base = os.environ.get("ACCUCHECK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "accucheck")
    return Path(base)


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines() * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")


# tiny mixtures of experts: the same size, 8 experts of which 2 per token in every layer
# (DeepSeek-V2: the first layer dense, one shared expert, MLA attention)
_MOE = dict(num_experts_per_tok=2)
TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(_MOE, moe_intermediate_size=128, num_experts=8, decoder_sparse_step=1,
                       norm_topk_prob=True, head_dim=32)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_MOE, moe_intermediate_size=128, shared_expert_intermediate_size=256,
                       num_experts=8, decoder_sparse_step=1)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_MOE, num_local_experts=8)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(_MOE, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=128,
                         first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=None,
                         qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
                         topk_method="greedy", n_group=1, topk_group=1)),
}


def write_tiny_model(out_dir: str | os.PathLike, seed: int = 0, arch: str = "llama",
                     **overrides) -> Path:
    """Build the tiny model (weights from `seed`) and its tokenizer into `out_dir`
    (save_pretrained layout: config.json, model.safetensors, tokenizer files). `arch`: one of
    TINY_ARCHS (default the Llama; the others are mixtures of experts)."""
    import torch
    import transformers

    if arch not in TINY_ARCHS:
        from accucheck.errors import UserError

        raise UserError.usage(f"unknown tiny architecture {arch!r}: use one of "
                              f"{', '.join(TINY_ARCHS)}")
    config_cls, model_cls, extra = TINY_ARCHS[arch]
    out = Path(out_dir)
    cfg = {k: v for k, v in TINY_CONFIG.items() if k != "rope_theta" or arch == "llama"}
    cfg.update(extra, **overrides)
    tokenizer = _train_tokenizer(cfg["vocab_size"])
    config = getattr(transformers, config_cls)(**cfg, bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id)
    gen = torch.random.fork_rng(devices=[])
    with gen:
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def tiny_model_dir(seed: int = 0, cache_dir: str | os.PathLike | None = None,
                   arch: str = "llama") -> Path:
    """The cached tiny model for `seed`, built on first use (atomically: never half-written)."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / f"tiny-{arch}-seed{seed}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=root))
    try:
        write_tiny_model(tmp, seed, arch)
        try:
            tmp.rename(target)
        except OSError:  # built concurrently by another process: keep theirs
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
