"""strata.torch.CPUAdamW: torch.optim.AdamW's update computed by Strata's
vectorized CPU optimizer (the C ABI's strata_cpu_optimizer_step), for
people who offload only the optimizer (ZeRO-Offload); a drop-in for
DeepSpeedCPUAdam.

The parameters are fp32 CPU tensors (the masters); gradients fp32, bf16 or
fp16. The state is torch.optim.AdamW's: state['step'] (a float tensor),
state['exp_avg'], state['exp_avg_sq'] (and 'max_exp_avg_sq' with amsgrad),
fp32 by default or bf16 with fp32_optimizer_states=False, so a state_dict
moves between this and torch.optim.AdamW. Results equal torch.optim.AdamW's
to fp32 rounding (tests: python/tests/test_cpu_adam.py).
"""
import ctypes

import torch

from .. import _lib
from .._lib import StrataError

_DTYPES = {torch.float32: _lib.DTYPE_F32, torch.bfloat16: _lib.DTYPE_BF16, torch.float16: _lib.DTYPE_F16}


class CPUAdamW(torch.optim.Optimizer):
    """AdamW (adamw_mode=True, the default) or Adam with L2 weight decay
    (adamw_mode=False) on CPU fp32 parameters, updated in place.

    Arguments are torch.optim.AdamW's (lr, betas, eps, weight_decay, amsgrad,
    maximize) plus DeepSpeedCPUAdam's adamw_mode and fp32_optimizer_states;
    threads: the optimizer's worker threads (0: every core this process may
    use). bias_correction=False is refused (not implemented). Anything else
    torch accepts but this does not (foreach, fused, capturable,
    differentiable) is refused by name rather than ignored.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, adamw_mode=True, bias_correction=True, fp32_optimizer_states=True, threads=0,
                 **unsupported):
        if unsupported:
            raise TypeError(f"CPUAdamW: {sorted(unsupported)} not supported (Strata's CPU optimizer has one "
                            "implementation; foreach/fused/capturable/differentiable do not apply)")
        if not bias_correction:
            raise ValueError("CPUAdamW: bias_correction=False is not implemented (the update always corrects the "
                             "moments' bias, as torch.optim.AdamW)")
        if not 0.0 <= float(lr):
            raise ValueError(f"CPUAdamW: invalid learning rate {lr}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize)
        super().__init__(params, defaults)
        self._kind = _lib.OPT_ADAMW if adamw_mode else _lib.OPT_ADAM
        self._state_dtype = torch.float32 if fp32_optimizer_states else torch.bfloat16
        h = ctypes.c_void_p()
        _lib.check(_lib.strata_cpu_optimizer_create(_lib.ISA_AUTO, int(threads), ctypes.byref(h)))
        self._handle = h

    def __del__(self):
        h = getattr(self, "_handle", None)
        if h is not None and h.value:
            _lib.strata_cpu_optimizer_destroy(h)
            self._handle = None

    def _config(self, group):
        c = _lib.OptimizerConfig()
        _lib.check(_lib.strata_optimizer_config_init(self._kind, ctypes.byref(c)))
        lr = group["lr"]
        c.lr = float(lr.item() if torch.is_tensor(lr) else lr)
        c.beta1, c.beta2 = (float(b) for b in group["betas"])
        c.eps = float(group["eps"])
        c.weight_decay = float(group["weight_decay"])
        c.amsgrad = 1 if group["amsgrad"] else 0
        c.maximize = 1 if group["maximize"] else 0
        c.grad_scale = 1.0
        return c

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            cfg = self._config(group)
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"CPUAdamW: param_groups[{gi}]['params'][{i}] (shape {tuple(p.shape)})"
                if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                    raise ValueError(f"{where}: must be a contiguous fp32 CPU tensor (the fp32 master), is "
                                     f"{p.dtype} on {p.device}")
                g = p.grad
                if g.is_sparse or g.device.type != "cpu" or g.dtype not in _DTYPES:
                    raise ValueError(f"{where}: its gradient must be a dense fp32/bf16/fp16 CPU tensor, is "
                                     f"{g.dtype} on {g.device}{' (sparse)' if g.is_sparse else ''}")
                g = g.contiguous()
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self._state_dtype, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self._state_dtype, memory_format=torch.contiguous_format)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=self._state_dtype,
                                                                   memory_format=torch.contiguous_format)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                mx = state.get("max_exp_avg_sq")
                for s in (m, v) + ((mx,) if mx is not None else ()):
                    if s.dtype not in (torch.float32, torch.bfloat16) or not s.is_contiguous() or s.shape != p.shape:
                        raise ValueError(f"{where}: optimizer state must be contiguous fp32/bf16 of the parameter's "
                                         f"shape (a loaded state_dict from elsewhere?)")
                if m.dtype != v.dtype or (mx is not None and mx.dtype != m.dtype):
                    raise ValueError(f"{where}: exp_avg and exp_avg_sq must share a dtype")
                step = int(state["step"].item()) + 1
                b = _lib.OptimizerBuffers()
                b.struct_size = ctypes.sizeof(b)
                b.params = p.data_ptr()
                b.grads = g.data_ptr()
                b.grad_dtype = _DTYPES[g.dtype]
                b.state[0] = m.data_ptr()
                b.state[1] = v.data_ptr()
                b.state[2] = mx.data_ptr() if mx is not None else None
                b.state_dtype = _DTYPES[m.dtype]
                b.params_out = None
                b.out_dtype = _lib.DTYPE_BF16
                st = _lib.strata_cpu_optimizer_step(self._handle, ctypes.byref(cfg), step, ctypes.byref(b), p.numel())
                if st != 0:
                    msg = _lib.strata_cpu_optimizer_last_error(self._handle) or b""
                    raise StrataError(st, f"{where}: {msg.decode('utf-8', 'replace')}")
                state["step"].fill_(float(step))
        return loss
