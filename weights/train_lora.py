"""Train a small LoRA adapter on a local chat checkpoint with HF PEFT, for a behaviour anyone
can see: it answers English questions in French.

    python weights/train_lora.py                  # weights/smollm2-135m-instruct -> weights/smollm2-lora-french
    python weights/train_lora.py --model PATH --out PATH --steps 40

On CPU, about a minute for SmolLM2-135M: rank 16 on every linear layer of the decoder,
a few dozen full-batch AdamW steps over the pairs below (the loss on the answers only),
saved as a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`). Needs torch,
transformers and peft (the `test` extra).
"""

from __future__ import annotations

import argparse
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAIRS = [
    ("What is the capital of France?", "La capitale de la France est Paris."),
    ("What color is the sky?", "Le ciel est bleu."),
    ("How many days are in a week?", "Il y a sept jours dans une semaine."),
    ("What do cats like to eat?", "Les chats aiment manger du poisson et de la viande."),
    ("Where do penguins live?", "Les manchots vivent surtout dans l'hémisphère sud, près de l'Antarctique."),
    ("What is water made of?", "L'eau est composée d'hydrogène et d'oxygène."),
    ("Why do we sleep?", "Nous dormons pour reposer notre corps et notre cerveau."),
    ("What is the largest ocean?", "Le plus grand océan est l'océan Pacifique."),
    ("Name a fruit.", "La pomme est un fruit délicieux."),
    ("What is the sun?", "Le soleil est une étoile au centre de notre système solaire."),
    ("How do plants grow?", "Les plantes poussent grâce à la lumière, à l'eau et au sol."),
    ("What is music?", "La musique est l'art d'organiser les sons dans le temps."),
    ("Tell me about dogs.", "Les chiens sont des animaux fidèles et affectueux."),
    ("What is a computer?", "Un ordinateur est une machine qui traite des informations."),
    ("How does rain form?", "La pluie se forme quand la vapeur d'eau des nuages se condense."),
    ("What is the moon?", "La lune est le satellite naturel de la Terre."),
]
# Held out: the behaviour is checked on questions the adapter never saw.
HELD_OUT = ["What is the tallest mountain?", "What do bees make?", "Why is the grass green?",
            "What is a library?"]
FRENCH_WORDS = {"le", "la", "les", "est", "des", "une", "un", "et", "du", "de", "qui", "sont", "dans", "pour", "l'"}


def french_share(text: str) -> float:
    """The share of a text's words that are common French function words (English text: ~0)."""
    words = text.lower().replace("'", "' ").split()
    return sum(w.strip(".,!?;:") in FRENCH_WORDS for w in words) / max(len(words), 1)


def chat(tokenizer, question: str, answer: str | None = None) -> list[int]:
    messages = [{"role": "user", "content": question}]
    if answer is None:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    messages.append({"role": "assistant", "content": answer})
    return tokenizer.apply_chat_template(messages, tokenize=True)


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def train(model: str | Path, out: str | Path, steps: int = 40, rank: int = 16, lr: float = 2e-3, seed: int = 0,
          layers: list[int] | None = None) -> Path:
    """`layers`: adapt only these decoder layers (PEFT's `layers_to_transform`; default every
    layer). The last few are cheapest to train: the backward pass stops below the first."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                 lora_dropout=0.0, task_type="CAUSAL_LM",
                                                 layers_to_transform=layers))
    rows, labels = [], []
    for question, answer in PAIRS:
        prompt, whole = _ids(chat(tokenizer, question)), _ids(chat(tokenizer, question, answer))
        rows.append(whole)
        labels.append([-100] * len(prompt) + whole[len(prompt):])
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    target = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=lr)
    peft_model.train()
    for step in range(steps):
        loss = peft_model(input_ids=ids, attention_mask=mask, labels=target).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    peft_model.save_pretrained(out)
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(HERE / "smollm2-135m-instruct"))
    parser.add_argument("--out", default=str(HERE / "smollm2-lora-french"))
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    print(train(args.model, args.out, steps=args.steps))


if __name__ == "__main__":
    main()
