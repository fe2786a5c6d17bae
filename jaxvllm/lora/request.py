"""vLLM's `LoRARequest`: which adapter a request runs with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive id the engine knows it by, and its PEFT folder
    (`adapter_config.json` and `adapter_model.safetensors`). Two requests with the same
    id are the same adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        # (the engine keeps ids in int64 arrays)
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or \
                not 1 <= self.lora_int_id < 2**63:
            raise ValueError(f"lora_int_id must be an int from 1 to 2**63 - 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path (the adapter's folder) is required")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
