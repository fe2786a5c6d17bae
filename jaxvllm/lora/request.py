"""vLLM's `LoRARequest`: which adapter a request runs with."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass


@dataclass(frozen=True, eq=False)
class LoRARequest:
    """An adapter by name, a positive id the engine knows it by, and its PEFT folder
    (`adapter_config.json` and `adapter_model.safetensors`). The engine knows an adapter
    by its id; two requests compare and hash by name, as vLLM's, so that sets and dicts
    of them hold one per adapter name."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_local_path: str | None = None  # vLLM's deprecated name of lora_path (its 4th field)
    long_lora_max_len: int | None = None  # vLLM's; only None
    base_model_name: str | None = None
    tensorizer_config_dict: dict | None = None  # vLLM's; only None (adapters are PEFT folders here)

    def __post_init__(self) -> None:
        if self.lora_local_path:
            warnings.warn("LoRARequest's lora_local_path is deprecated (as in vLLM 0.11); use lora_path",
                          DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "lora_path", self.lora_path or self.lora_local_path)
        if self.tensorizer_config_dict is not None:
            raise ValueError(f"LoRARequest {self.lora_name!r}: tensorizer_config_dict (an adapter serialized with "
                             f"tensorizer) is not supported by jaxvllm; give lora_path a PEFT folder")
        if self.long_lora_max_len is not None:
            raise ValueError(f"LoRARequest long_lora_max_len={self.long_lora_max_len!r}: long-context LoRA is not "
                             "supported by jaxvllm")
        # (the engine keeps ids in int64 arrays)
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or \
                not 1 <= self.lora_int_id < 2**63:
            raise ValueError(f"lora_int_id must be an int from 1 to 2**63 - 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path (the adapter's folder) is required")
        # ("~" expanded, as vLLM's get_adapter_absolute_path; a relative folder is read from the
        # working directory, and kept as given, as processes of a multi-host engine compare it)
        object.__setattr__(self, "lora_path", os.path.expanduser(str(self.lora_path)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, type(self)) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
