"""The built-in Megatron trainer: a GPT model on megatron-core, trained on CPU or GPU.

``TrainEngine`` (``engine.py``) is one rank of a training job without Ray; the Ray worker
``MegatronTrainer`` lives in ``worker.py`` (imported lazily: it needs the controller layer).
"""

from tgruntime.trainer.engine import StepResult, TrainEngine

__all__ = ["StepResult", "TrainEngine"]
