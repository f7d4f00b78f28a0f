"""Strata for PyTorch.

    import strata.torch
    engine, optimizer, _, scheduler = strata.torch.initialize(model=model, config="ds_config.json")
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

initialize() offloads a torch model's parameters, gradients and optimizer
state to Strata's engine (host RAM or NVMe) the way DeepSpeed ZeRO-3 with
offload_param / offload_optimizer does, with the config's DeepSpeed
"scheduler" section (lr_schedules); StrataTrainer is the Hugging Face
transformers.Trainer on that engine (importing it needs transformers);
CPUAdamW is Strata's CPU AdamW as a torch optimizer (torch.optim.AdamW's
arguments), DeepSpeedCPUAdam the same with DeepSpeed's. See docs/python.md.
"""
from . import lr_schedules
from .cpu_adam import CPUAdamW, DeepSpeedCPUAdam
from .engine import StrataEngine, initialize, register_external_parameter

__all__ = ["CPUAdamW", "DeepSpeedCPUAdam", "StrataEngine", "StrataTrainer", "initialize", "lr_schedules", "register_external_parameter"]


def __getattr__(name):
    # transformers is imported only when StrataTrainer is asked for.
    if name == "StrataTrainer":
        from .hf_trainer import StrataTrainer
        return StrataTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
