"""Write tiny random HF checkpoints (config, safetensors, tokenizer) with no downloads.

Tests, notebooks and the quickstart use these so that every machine has a model:

    python weights/make_tiny.py --arch qwen3 --out weights/tiny-qwen3
    python weights/make_tiny.py --all --out weights/        # one folder per architecture

or from Python (tests import it as `weights.make_tiny`):

    from weights.make_tiny import make_tiny
    path = make_tiny("llama", "/tmp/tiny-llama")

The models are built with transformers (`from_config` + `save_pretrained`, so torch
is needed here, not in the engine) and the tokenizer is a byte-level BPE trained on
the spot (`jaxvllm.dummy.make_tokenizer`, shared with `--model dummy:NAME`), so any
text encodes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxvllm.dummy import make_tokenizer  # one tokenizer for tiny checkpoints and dummy:NAME models

# A tiny hidden size keeps CPU tests fast; head_dim 16 and a rope scaling / bias /
# qk-norm per family exercise what differs between the architectures.
_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    # Larger than the usual 0.02 so logits are spread out and greedy choices are
    # not near-ties that float rounding could flip.
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

ARCHITECTURES: dict[str, dict] = {
    # Llama 3 style: GQA (4 q heads, 2 kv heads), llama3 rope scaling, untied head.
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    # Mistral: GQA, no window by default (tests set `sliding_window` to check it).
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        sliding_window=None,
    ),
    # Qwen2: bias on q/k/v, MHA, tied embeddings.
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    ),
    # Qwen3: RMSNorm on q and k, explicit head_dim larger than hidden/heads, GQA group 4.
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
    ),
    # Gemma 3 (text): sliding and global layers alternating (window 8, local RoPE base 10k,
    # global base 1M with linear scaling), q/k norms, query_pre_attn_scalar != head_dim,
    # tied embeddings. Its norm weights are made random (HF initializes them to 0, a
    # (1 + w) scale of 1), so that each norm's weight matters.
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="linear", rope_theta=1000000.0, factor=8.0),
        ),
        tie_word_embeddings=True,
    ),
    # Qwen3-MoE: q/k norms, 8 experts (top 2, weights not renormalized: HF's default), layer 0
    # sparse and layer 1 a dense MLP (`mlp_only_layers`), untied head.
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
    # Mixtral: every layer sparse, 4 experts of intermediate_size 64 (top 2, renormalized), GQA.
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
}

# Architectures whose RMSNorm weights get random values (see "gemma3" above).
_RANDOM_NORMS = ("gemma3",)

def make_tiny(
    arch: str,
    path: str | Path,
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    save_original_format: bool = True,
    extra_tokens: int = 0,
    **overrides,
) -> Path:
    """Write a tiny random checkpoint of `arch` (a key of ARCHITECTURES: "llama", "qwen3", "gemma3", ...).

    `overrides` go into the transformers config (e.g. `sliding_window=8`);
    `max_shard_size` (e.g. "30KB") writes several shards plus the index file;
    `save_original_format=False` writes transformers 5's own layout (a mixture of experts'
    experts fused into [E, ...] tensors) instead of the per-expert one;
    `extra_tokens` special tokens <|extra_0|>, ... are added to the tokenizer after its own
    ids, past the model's vocabulary if `vocab_size` leaves no room (as transformers 5 adds
    an <|endoftext|> to Qwen2's tokenizer), to test tokenizers larger than the model.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(ARCHITECTURES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {**_COMMON, **ARCHITECTURES[arch], **overrides}
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch in _RANDOM_NORMS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.2)
    model = model.to(getattr(torch, dtype)).eval()
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if not save_original_format:
        save_kwargs["save_original_format"] = False
    model.save_pretrained(str(path), **save_kwargs)
    tokenizer = make_tokenizer(path)
    assert len(tokenizer) <= config.vocab_size
    if extra_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": [f"<|extra_{i}|>" for i in range(extra_tokens)]})
        tokenizer.save_pretrained(str(path))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES))
    parser.add_argument("--all", action="store_true", help="write every architecture")
    parser.add_argument("--out", required=True, help="checkpoint folder (with --all: parent folder)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.all == bool(args.arch):
        parser.error("give exactly one of --arch or --all")
    archs = sorted(ARCHITECTURES) if args.all else [args.arch]
    for arch in archs:
        out = Path(args.out) / f"tiny-{arch}" if args.all else Path(args.out)
        make_tiny(arch, out, seed=args.seed, dtype=args.dtype)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
