"""LoRA adapters on the trainer's megatron GPT model (tensor- and pipeline-parallel aware).

``settings`` (:class:`LoraSettings`), ``adapters`` (the per-linear modules), ``inject``
(hooks on a built model, freezing), ``optim`` (AdamW over the adapters only, memory
figures), ``state`` (per-rank save/load, PEFT and merged exports). See docs/lora.md.
"""

from tgruntime.trainer.lora.adapters import LinearLora, Part, initial_a
from tgruntime.trainer.lora.inject import (
    LoraAdapters,
    adapter_parameters,
    freeze_base,
    inject_lora,
)
from tgruntime.trainer.lora.optim import (
    AdapterTrainingState,
    adam_state_bytes,
    build_adapter_training_state,
    optimizer_state_bytes,
)
from tgruntime.trainer.lora.settings import DEFAULT_ALPHA, DEFAULT_RANK, LoraSettings
from tgruntime.trainer.lora.state import (
    adapter_config,
    export_peft,
    gather_full,
    import_peft,
    load_adapter_state,
    load_full,
    read_peft,
    save_adapter_state,
)

__all__ = [
    "DEFAULT_ALPHA",
    "DEFAULT_RANK",
    "AdapterTrainingState",
    "LinearLora",
    "LoraAdapters",
    "LoraSettings",
    "Part",
    "adam_state_bytes",
    "adapter_config",
    "adapter_parameters",
    "build_adapter_training_state",
    "export_peft",
    "freeze_base",
    "gather_full",
    "import_peft",
    "initial_a",
    "inject_lora",
    "load_adapter_state",
    "load_full",
    "optimizer_state_bytes",
    "read_peft",
    "save_adapter_state",
]
