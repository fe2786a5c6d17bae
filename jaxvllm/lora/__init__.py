"""Multi-LoRA serving: PEFT adapters over the base model, several in one batch (see
`docs/design.md`, "LoRA")."""

from jaxvllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
