"""Tiny EAGLE and EAGLE-3 heads in their published checkpoint layouts (as vLLM's
`llama_eagle.py` / `llama_eagle3.py` read them), and a torch reference of what a head
drafts after a context: dense causal attention, recomputed over the whole sequence."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file


def make_head(target: Path, out: Path, method: str, *, seed: int = 0, draft_vocab: int | None = None,
              aux_layers: list[int] | None = None, scale: float = 0.1, **overrides) -> Path:
    """A one-layer head for the tiny checkpoint `target`, random weights (normal * `scale`);
    `overrides` replace tensors by name (numpy arrays)."""
    cfg = json.loads((target / "config.json").read_text())
    d, hd = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    hq, hkv, f, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"]
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (rng.standard_normal(shape) * scale).astype(np.float32)  # noqa: E731
    ones = lambda n: (1 + rng.standard_normal(n) * 0.1).astype(np.float32)  # noqa: E731
    prefix = "layers.0." if method == "eagle" else "midlayer."
    qkv_in = d if method == "eagle" else 2 * d
    tensors = {
        f"{prefix}self_attn.q_proj.weight": normal(hq * hd, qkv_in),
        f"{prefix}self_attn.k_proj.weight": normal(hkv * hd, qkv_in),
        f"{prefix}self_attn.v_proj.weight": normal(hkv * hd, qkv_in),
        f"{prefix}self_attn.o_proj.weight": normal(d, hq * hd),
        f"{prefix}post_attention_layernorm.weight": ones(d),
        f"{prefix}mlp.gate_proj.weight": normal(f, d),
        f"{prefix}mlp.up_proj.weight": normal(f, d),
        f"{prefix}mlp.down_proj.weight": normal(d, f),
    }
    head_cfg = dict(cfg, num_hidden_layers=1)
    head_cfg.pop("layer_types", None)
    if method == "eagle":
        head_cfg["architectures"] = ["EagleLlamaForCausalLM"]
        tensors["fc.weight"] = normal(d, 2 * d)
    else:
        head_cfg["architectures"] = ["LlamaForCausalLMEagle3"]
        draft_vocab = draft_vocab or vocab
        head_cfg["draft_vocab_size"] = draft_vocab
        if aux_layers is not None:
            head_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
        tensors.update({
            "fc.weight": normal(d, 3 * d),
            f"{prefix}input_layernorm.weight": ones(d),
            f"{prefix}hidden_norm.weight": ones(d),
            "norm.weight": ones(d),
            "lm_head.weight": normal(draft_vocab, d) * 10,
        })
        ids = np.sort(rng.choice(vocab, draft_vocab, replace=False))
        tensors["d2t"] = (ids - np.arange(draft_vocab)).astype(np.int64)
        tensors["t2d"] = np.isin(np.arange(vocab), ids)
    tensors.update(overrides)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(head_cfg))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def passing_head(target: Path, out: Path) -> Path:
    """An EAGLE head that passes the target's final state through (fc = [0 | I], its layer's
    outputs zero): it drafts, K times, the token the target chose last, which a random
    model often repeats, so some drafts pass and some do not on any architecture."""
    cfg = json.loads((target / "config.json").read_text())
    d, f, hq = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or d // hq
    zero = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    passing = {"fc.weight": np.concatenate([zero(d, d), np.eye(d, dtype=np.float32)], 1),
               "layers.0.self_attn.o_proj.weight": zero(d, hq * hd), "layers.0.mlp.down_proj.weight": zero(d, f)}
    return make_head(target, out, "eagle", **passing)


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _layer_attention(w, prefix, x, positions, cfg, rotary):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    n = x.shape[0]
    q = (x @ w[prefix + "self_attn.q_proj.weight"].T).view(n, hq, hd).transpose(0, 1)
    k = (x @ w[prefix + "self_attn.k_proj.weight"].T).view(n, hkv, hd).transpose(0, 1)
    v = (x @ w[prefix + "self_attn.v_proj.weight"].T).view(n, hkv, hd).transpose(0, 1)
    cos, sin = rotary(v[None], positions[None])
    q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    q, k = q[0], k[0].repeat_interleave(hq // hkv, 0)
    v = v.repeat_interleave(hq // hkv, 0)
    scores = q @ k.transpose(1, 2) / hd**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, hq * hd)
    return out @ w[prefix + "self_attn.o_proj.weight"].T


def _mlp(w, prefix, x):
    gate, up = x @ w[prefix + "mlp.gate_proj.weight"].T, x @ w[prefix + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[prefix + "mlp.down_proj.weight"].T


def reference_drafts(target_model, head: Path, method: str, context: list[int], k: int,
                     aux_layers: list[int] | None = None) -> list[int]:
    """The K tokens the head drafts after `context` (its newest token not yet computed by the
    target), from the HF target `target_model` (float32)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    w = load_file(head / "model.safetensors")
    raw = json.loads((head / "config.json").read_text())
    cfg = LlamaConfig.from_dict({k_: v for k_, v in raw.items() if k_ not in ("architectures", "model_type")})
    rotary, eps = LlamaRotaryEmbedding(cfg), cfg.rms_norm_eps
    embed = target_model.get_input_embeddings().weight
    with torch.no_grad():
        out = target_model(torch.tensor([context[:-1]]), output_hidden_states=True)
        if method == "eagle":
            hidden = out.hidden_states[-1][0]  # the final-normed states
        else:
            hidden = torch.cat([out.hidden_states[i][0] for i in aux_layers], -1) @ w["fc.weight"].T
        tokens = list(context[1:])
        drafts = []
        for _ in range(k):
            n = len(tokens)
            positions = torch.arange(n)
            e = embed[torch.tensor(tokens)]
            if method == "eagle":
                x = torch.cat([e, hidden], -1) @ w["fc.weight"].T
                x = x + _layer_attention(w, "layers.0.", x, positions, cfg, rotary)
                x = x + _mlp(w, "layers.0.", _rms(x, w["layers.0.post_attention_layernorm.weight"], eps))
                states = x
                logits = target_model.lm_head(states[-1])
                token = int(logits.argmax())
            else:
                p = "midlayer."
                normed = _rms(hidden, w[p + "hidden_norm.weight"], eps)
                a = torch.cat([_rms(e, w[p + "input_layernorm.weight"], eps), normed], -1)
                x = hidden + _layer_attention(w, p, a, positions, cfg, rotary)
                x = x + _mlp(w, p, _rms(x, w[p + "post_attention_layernorm.weight"], eps))
                states = _rms(x, w["norm.weight"], eps)
                best = int((states[-1] @ w["lm_head.weight"].T).argmax())
                token = best + int(w["d2t"][best])
            drafts.append(token)
            tokens.append(token)
            hidden = torch.cat([hidden, x[-1:]], 0)
    return drafts
