"""Strata for PyTorch.

    import strata.torch
    engine, optimizer, _, scheduler = strata.torch.initialize(model=model, config="ds_config.json")
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

initialize() offloads a torch model's parameters, gradients and optimizer
state to Strata's engine (host RAM or NVMe) the way DeepSpeed ZeRO-3 with
offload_param / offload_optimizer does; CPUAdamW is Strata's CPU AdamW as a
torch optimizer. See docs/python.md.
"""
from .cpu_adam import CPUAdamW
from .engine import StrataEngine, initialize

__all__ = ["CPUAdamW", "StrataEngine", "initialize"]
