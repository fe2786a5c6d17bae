"""Train a small EAGLE head for a local checkpoint on the model's own outputs (self-distillation),
so that EAGLE's acceptance and speed can be measured on a trained model with no download.

    python weights/train_eagle.py                    # weights/smollm2-135m-instruct -> weights/smollm2-eagle
    python weights/train_eagle.py --model PATH --out PATH --steps 600

What it does, on CPU in minutes for SmolLM2-135M:

1. jaxvllm generates answers (temperature 0.7) to chat prompts made from templates x topics;
2. HF transformers runs the target over each prompt + answer, keeping its final-normed hidden
   states h and its greedy choice at every position;
3. a one-layer head in EAGLE's layout (`fc` over (embedding of token p + 1, h_p), then a
   Llama layer with no input norm, started from the target's last layer) learns h_{p+1}
   (smooth L1) and the target's greedy token after it (cross-entropy through the target's own
   lm_head), as the EAGLE paper trains;
4. it is saved as `config.json` + `model.safetensors` with EAGLE's tensor names, for
   `speculative_config={"method": "eagle", "model": OUT, ...}`.

Needs torch and transformers (the `test` extra). A head trained this briefly drafts well below
a published one; it is for measuring the engine, not for serving.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEMPLATES = [
    "Explain {} to a ten-year-old.", "Write a short story about {}.", "List five facts about {}.",
    "What are the pros and cons of {}?", "Write a poem about {}.", "Summarize the history of {}.",
    "Give step-by-step instructions related to {}.", "Describe {} in detail.",
]
TOPICS = [
    "the ocean", "volcanoes", "bread baking", "the moon", "honey bees", "electric cars", "chess", "rainforests",
    "the Roman Empire", "photosynthesis", "coffee", "mountain climbing", "recycling", "the human heart",
    "solar panels", "penguins", "jazz music", "the internet", "gardening", "dinosaurs", "friendship", "clouds",
    "trains", "the Olympic games", "libraries", "rivers", "birds", "computers", "cheese", "the desert", "robots",
    "healthy sleep",
]


def generate(model: str, num_prompts: int, max_tokens: int) -> list[list[int]]:
    """Prompt + answer token ids, from jaxvllm."""
    from jaxvllm import LLM, SamplingParams

    prompts = [[{"role": "user", "content": t.format(topic)}] for topic in TOPICS for t in TEMPLATES][:num_prompts]
    with LLM(model, dtype="float32", max_model_len=512, max_num_seqs=64) as llm:
        outputs = llm.chat(prompts, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=max_tokens, seed=0),
                           use_tqdm=True)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]


def features(model: str, sequences: list[list[int]]):
    """The target's final-normed hidden states and greedy next tokens of each sequence."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    data = []
    with torch.no_grad():
        for ids in sequences:
            out = hf(torch.tensor([ids]), output_hidden_states=True)
            data.append((torch.tensor(ids), out.hidden_states[-1][0], out.logits[0].argmax(-1)))
    return hf, data


class Head:
    """EAGLE's head as torch tensors (names as the checkpoint has them), from the target's last layer."""

    def __init__(self, hf, config):
        import torch
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        last = len(hf.model.layers) - 1
        state = hf.state_dict()
        d = config.hidden_size
        self.w = {name.replace(f"model.layers.{last}.", "layers.0."): t.clone()
                  for name, t in state.items() if name.startswith(f"model.layers.{last}.")
                  and "input_layernorm" not in name}
        # Start as the identity on the target's state (fc passes it, the layer adds nothing), so that
        # the first drafts repeat the target's own last choice.
        self.w["fc.weight"] = torch.cat([torch.randn(d, d) * 0.01, torch.eye(d)], 1)
        for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
            self.w[name].zero_()
        for t in self.w.values():
            t.requires_grad_(True)
        self.cfg, self.rotary = config, LlamaRotaryEmbedding(config)
        self.embed = hf.get_input_embeddings().weight.detach()
        self.lm_head = hf.lm_head.weight.detach()

    def __call__(self, tokens, hidden):
        import torch
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        w, cfg, n = self.w, self.cfg, tokens.shape[0]
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        hd = cfg.hidden_size // hq
        x = torch.cat([self.embed[tokens], hidden], -1) @ w["fc.weight"].T
        q = (x @ w["layers.0.self_attn.q_proj.weight"].T).view(n, hq, hd).transpose(0, 1)
        k = (x @ w["layers.0.self_attn.k_proj.weight"].T).view(n, hkv, hd).transpose(0, 1)
        v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(n, hkv, hd).transpose(0, 1)
        cos, sin = self.rotary(v[None], torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        att = torch.nn.functional.scaled_dot_product_attention(
            q, k[0].repeat_interleave(hq // hkv, 0)[None], v.repeat_interleave(hq // hkv, 0)[None], is_causal=True)
        x = x + att[0].transpose(0, 1).reshape(n, -1) @ w["layers.0.self_attn.o_proj.weight"].T
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w["layers.0.post_attention_layernorm.weight"]
        gate, up = h @ w["layers.0.mlp.gate_proj.weight"].T, h @ w["layers.0.mlp.up_proj.weight"].T
        return x + (torch.nn.functional.silu(gate) * up) @ w["layers.0.mlp.down_proj.weight"].T


def train(head: Head, data, steps: int, batch: int, lr: float) -> None:
    import torch

    opt = torch.optim.AdamW(head.w.values(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    start = time.time()
    for step in range(steps):
        for group in opt.param_groups:  # warm-up, then cosine
            group["lr"] = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss_sum, hits, count = 0.0, 0, 0
        for i in torch.randint(len(data), (batch,), generator=gen).tolist():
            ids, hidden, greedy = data[i]
            # Position p reads (token p + 1, h_p) and predicts h_{p + 1} and the target's choice after it.
            noisy = hidden[:-2] + (torch.rand_like(hidden[:-2]) - 0.5) * 0.2  # (EAGLE's feature noise)
            out = head(ids[1:-1], noisy)
            logits = out @ head.lm_head.T
            loss = torch.nn.functional.smooth_l1_loss(out, hidden[1:-1]) + 0.1 * torch.nn.functional.cross_entropy(
                logits, greedy[1:-1])
            (loss / batch).backward()
            loss_sum += float(loss.detach())
            hits += int((logits.argmax(-1) == greedy[1:-1]).sum())
            count += len(greedy) - 2
        opt.step()
        opt.zero_grad()
        if step % 20 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss_sum / batch:.4f}, top-1 agreement {hits / count:.3f}, "
                  f"{time.time() - start:.0f} s", flush=True)


def save(head: Head, model: str, out: Path) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(model) / "config.json").read_text())
    cfg.update(num_hidden_layers=1, architectures=["EagleLlamaForCausalLM"], torch_dtype="float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.detach().contiguous() for k, v in head.w.items()}, out / "model.safetensors",
              metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(HERE / "smollm2-135m-instruct"))
    parser.add_argument("--out", default=str(HERE / "smollm2-eagle"))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    import torch

    torch.manual_seed(0)
    sequences = generate(args.model, args.num_prompts, args.max_tokens)
    hf, data = features(args.model, sequences)
    head = Head(hf, hf.config)
    train(head, data, args.steps, args.batch, args.lr)
    save(head, args.model, Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
