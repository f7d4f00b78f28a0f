"""strata.torch.CPUAdamW: torch.optim.AdamW's update computed by Strata's
vectorized CPU optimizer (the C ABI's strata_cpu_optimizer_step), for
people who offload only the optimizer (ZeRO-Offload), with torch.optim.AdamW's
arguments and defaults; DeepSpeedCPUAdam (end of this file) is the drop-in for
deepspeed.ops.adam.DeepSpeedCPUAdam (its signature and defaults).

The parameters are fp32 CPU tensors (the masters); gradients fp32, bf16 or
fp16. The state is torch.optim.AdamW's: state['step'] (a float tensor),
state['exp_avg'], state['exp_avg_sq'] (and 'max_exp_avg_sq' with amsgrad),
fp32 by default or bf16 with fp32_optimizer_states=False, so a state_dict
moves between this and torch.optim.AdamW. Results equal torch.optim.AdamW's
to fp32 rounding (tests: python/tests/test_cpu_adam.py).

Optimizer states on NVMe (nvme_path=, or DeepSpeed's offload_optimizer
section with device "nvme"): exp_avg, exp_avg_sq (and max_exp_avg_sq) live
in a Strata engine's swap files (io_uring, checksummed blocks) under a
temporary directory of nvme_path; self.state[p] keeps only 'step'. Each
step reads a parameter's moments, runs the same kernel on the parameter in
place (the torch tensor stays the master) and writes the moments back, so
results are bit-identical to the RAM mode. The engine's tensors have at
most 4M elements: small parameters share one (few I/O calls for many small
tensors), large ones are cut in pieces (bounded RAM). Why not the engine's
own optimizer step: docs/python.md.
"""
import collections
import contextlib
import ctypes
import json
import math
import os
import shutil
import tempfile
import weakref

import torch

from .. import _lib
from .._lib import StrataError

_DTYPES = {torch.float32: _lib.DTYPE_F32, torch.bfloat16: _lib.DTYPE_BF16, torch.float16: _lib.DTYPE_F16}
_STATE_KEYS = ("exp_avg", "exp_avg_sq")
# Elements per engine tensor: smaller parameters share one (one read and
# one write per moment for all of them), larger ones are cut in pieces this
# size (the RAM of the scratch and of the engine's buffers follows the
# largest tensor). 4M: the engine's own I/O piece.
_BUCKET_ELEMS = 4 << 20
# DeepSpeed's offload_optimizer keys that tune DeepSpeed's own swapper (its
# buffers and pipelining); accepted so its section can be passed as it is.
_DS_OFFLOAD_TUNING = {"pin_memory", "buffer_count", "fast_init", "pipeline", "pipeline_read", "pipeline_write",
                      "ratio"}


def _step_of(state):
    """state['step'] as an int (a tensor in torch's layout; a number in old state dicts)."""
    s = state["step"]
    return int(s.item()) if torch.is_tensor(s) else int(s)


def _next_step(state, where):
    """state['step'] + 1, checked first: a loaded state_dict's step must be a whole number of steps
    taken (the kernel counts from 1), refused by name before any parameter moves otherwise."""
    try:
        s = state["step"]
        s = float(s.item()) if torch.is_tensor(s) else float(s)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ValueError(f"{where}: its optimizer state's step is not a number ({e})") from None
    if not (math.isfinite(s) and 0 <= s < 2.0 ** 62 and s == int(s)):
        raise ValueError(f"{where}: its optimizer state's step is {s}: expected a whole number of steps taken, "
                         "from 0")
    return int(s) + 1


def _set_step(state, step):
    s = state.get("step")
    if torch.is_tensor(s):
        s.fill_(float(step))  # in place, as torch.optim.AdamW
    else:
        state["step"] = torch.tensor(float(step), dtype=torch.float32)


def _release_engine(engine, directory, pid):
    # weakref.finalize's callback: never references the store, so it runs when
    # the optimizer is garbage-collected or at interpreter exit. A forked child
    # (a DataLoader worker) must not delete its parent's files.
    if os.getpid() != pid:
        return
    if engine.value:
        _lib.strata_engine_destroy(engine)
        engine.value = None
    shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _hooks_held(opt, *names):
    """torch's hook tables `names` of opt emptied while the block runs (yields their hooks, in order, one list
    per name, or the list for one name): NVMe mode runs them itself, where torch would run them too early."""
    held = [getattr(opt, n) for n in names]
    for n in names:
        setattr(opt, n, collections.OrderedDict())
    try:
        lists = [list(h.values()) for h in held]
        yield lists[0] if len(lists) == 1 else tuple(lists)
    finally:
        for n, h in zip(names, held):
            setattr(opt, n, h)


class _NvmeStore:
    """Optimizer states on NVMe: one Strata engine whose trainable tensors are
    storage only (strata_engine_read_state / load_state of its states 0 and 1);
    its own optimizer step is never run. Tensor t has `sizes[t]` elements."""

    def __init__(self, sizes, names, root, state_dtype, aio):
        os.makedirs(root, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="strata-cpuadamw-", dir=root)
        self.sizes = list(sizes)
        engine = ctypes.c_void_p()
        # Destroying the engine and deleting the directory happen in one place,
        # also when creation fails half-way.
        self._finalizer = weakref.finalize(self, _release_engine, engine, self.dir, os.getpid())
        cfg = {
            "zero_optimization": {
                "offload_optimizer": {"device": "nvme", "nvme_path": self.dir, "buffer_count": 1},
                # The engine also places a compute copy, an fp32 master and a
                # gradient accumulator per tensor (it would need them for its
                # own step): all on NVMe, bf16 compute, the smallest buffers,
                # so they cost disk space and no RAM.
                "offload_param": {"device": "nvme", "nvme_path": self.dir, "buffer_count": 1, "buffer_size": 2048},
            },
            "strata": {"groups": [{"match": "*", "grad": "nvme"}], "prefetch_depth": 0, "optimizer_chunk": 2048,
                       "optimizer_state_dtype": "fp32" if state_dtype == torch.float32 else "bf16"},
        }
        if aio is not None:
            cfg["aio"] = dict(aio)
        descs = (_lib.ParamDesc * len(self.sizes))()
        keep = []
        for t, (n, name) in enumerate(zip(self.sizes, names)):
            d = descs[t]
            d.struct_size = ctypes.sizeof(_lib.ParamDesc)
            b = name.encode()
            keep.append(b)
            d.name = d.group = b
            d.ndim = 1
            d.shape[0] = n
            d.dtype = _lib.DTYPE_BF16
        opts = _lib.EngineOptions()
        _lib.check(_lib.strata_engine_options_init(ctypes.byref(opts)))
        cfg_bytes = json.dumps(cfg).encode()
        opts.config_json = cfg_bytes
        opts.device_kind = _lib.DEVICE_HOST
        try:
            _lib.check(_lib.strata_engine_create(ctypes.byref(opts), descs, len(self.sizes), ctypes.byref(engine)))
        except BaseException:
            self._finalizer()
            raise
        self._e = engine

    @property
    def closed(self):
        return not self._finalizer.alive

    def read(self, t, k, dst):
        """State k (0 or 1) of tensor t into the fp32 tensor dst (contiguous, sizes[t] elements)."""
        _lib.check(_lib.strata_engine_read_state(self._e, t, k, dst.data_ptr(), self.sizes[t]), self._e)

    def write(self, t, k, src):
        _lib.check(_lib.strata_engine_load_state(self._e, t, k, src.data_ptr(), self.sizes[t]), self._e)

    def close(self):
        self._finalizer()


class CPUAdamW(torch.optim.Optimizer):
    """AdamW (adamw_mode=True, the default) or Adam with L2 weight decay
    (adamw_mode=False) on CPU fp32 parameters, updated in place.

    Arguments are torch.optim.AdamW's (lr, betas, eps, weight_decay, amsgrad,
    maximize) plus DeepSpeedCPUAdam's adamw_mode and fp32_optimizer_states;
    threads: the optimizer's worker threads (0: every core this process may
    use). bias_correction=False is refused (not implemented). torch's foreach
    and fused pick a kernel, not the math: accepted, one kernel here.
    capturable and differentiable are refused by name, as is any other
    keyword. A group's decoupled_weight_decay (torch 2) picks AdamW's decay or
    Adam's L2 for that group; adamw_mode gives the default.

    Optimizer states on NVMe: nvme_path="/local_nvme" (a directory on the SSD;
    created if missing), or offload_optimizer= DeepSpeed's
    zero_optimization.offload_optimizer section as it is ({"device": "nvme",
    "nvme_path": ...}; "cpu" keeps the states in RAM; its buffer and pipeline
    keys tune DeepSpeed's swapper and are accepted without effect); aio=
    DeepSpeed's "aio" section (block_size, queue_depth, ...). The states go
    to a temporary directory under nvme_path, deleted by close() or when the
    optimizer is garbage-collected.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, adamw_mode=True, bias_correction=True, fp32_optimizer_states=True, threads=0,
                 nvme_path=None, offload_optimizer=None, aio=None, foreach=None, fused=None, capturable=False,
                 differentiable=False, **unsupported):
        # torch's implementation choices: foreach and fused pick a kernel, not
        # the math (one implementation here); capturable (CUDA graphs) and
        # differentiable (autograd through the step) would change what step() is.
        for name, value in (("capturable", capturable), ("differentiable", differentiable)):
            if value:
                raise TypeError(f"CPUAdamW: {name}=True is not supported (Strata's CPU optimizer steps outside "
                                "autograd and CUDA graphs)")
        if unsupported:
            raise TypeError(f"CPUAdamW: {sorted(unsupported)} not supported (Strata's CPU optimizer has one "
                            "implementation)")
        if not bias_correction:
            raise ValueError("CPUAdamW: bias_correction=False is not implemented (the update always corrects the "
                             "moments' bias, as torch.optim.AdamW)")
        # torch.optim.AdamW's checks, at construction as torch makes them.
        if not 0.0 <= float(lr):
            raise ValueError(f"CPUAdamW: invalid learning rate {lr}")
        if not 0.0 <= float(eps):
            raise ValueError(f"CPUAdamW: invalid epsilon value {eps}")
        for i, b in enumerate(betas):
            if not 0.0 <= float(b) < 1.0:
                raise ValueError(f"CPUAdamW: invalid beta parameter at index {i}: {b}")
        if not 0.0 <= float(weight_decay):
            raise ValueError(f"CPUAdamW: invalid weight_decay value {weight_decay}")
        self._nvme_path = self._resolve_nvme_path(nvme_path, offload_optimizer)
        if aio is not None and self._nvme_path is None and offload_optimizer is None:
            # With DeepSpeed's sections passed as they are, "device": "cpu" and an
            # "aio" section is a valid config (DeepSpeed then ignores aio too).
            raise ValueError("CPUAdamW: aio= configures the NVMe I/O; give nvme_path= (or offload_optimizer with "
                             "device \"nvme\") too")
        self._aio = dict(aio) if aio is not None else None
        self._store = None      # the NVMe store (NVMe mode), built after the param groups
        self._closed = False
        # decoupled_weight_decay: torch 2's per-group switch between AdamW's
        # decoupled decay and Adam's L2, honoured per group as torch does;
        # adamw_mode gives every group's default.
        self._adamw = bool(adamw_mode)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, decoupled_weight_decay=self._adamw)
        super().__init__(params, defaults)
        self._state_dtype = torch.float32 if fp32_optimizer_states else torch.bfloat16
        h = ctypes.c_void_p()
        _lib.check(_lib.strata_cpu_optimizer_create(_lib.ISA_AUTO, int(threads), ctypes.byref(h)))
        self._handle = h
        if self._nvme_path is not None:
            self._has_max = set()  # params whose state has max_exp_avg_sq (torch: amsgrad when it began)
            self._scratch = None
            self._build_store({})

    @staticmethod
    def _resolve_nvme_path(nvme_path, offload_optimizer):
        if offload_optimizer is None:
            return os.fspath(nvme_path) if nvme_path is not None else None
        if not isinstance(offload_optimizer, dict):
            raise TypeError("CPUAdamW: offload_optimizer must be a dict (DeepSpeed's "
                            "zero_optimization.offload_optimizer section)")
        unknown = set(offload_optimizer) - {"device", "nvme_path"} - _DS_OFFLOAD_TUNING
        if unknown:
            raise ValueError(f"CPUAdamW: offload_optimizer: unknown key(s) {sorted(unknown)} (DeepSpeed's "
                             f"offload_optimizer keys: device, nvme_path, {', '.join(sorted(_DS_OFFLOAD_TUNING))})")
        device = offload_optimizer.get("device", "cpu")
        ds_path = offload_optimizer.get("nvme_path")
        if device in ("cpu", None):
            if nvme_path is not None:
                raise ValueError(f"CPUAdamW: nvme_path={nvme_path!r} with offload_optimizer device \"cpu\" "
                                 "(states in RAM): give one")
            return None
        if device != "nvme":
            raise ValueError(f"CPUAdamW: offload_optimizer device {device!r}: this optimizer keeps its states "
                             "in RAM (\"cpu\") or on NVMe (\"nvme\")")
        if nvme_path is not None and ds_path is not None and os.fspath(nvme_path) != os.fspath(ds_path):
            raise ValueError(f"CPUAdamW: nvme_path={nvme_path!r} and offload_optimizer nvme_path={ds_path!r} "
                             "differ: give one")
        path = nvme_path if nvme_path is not None else ds_path
        if path is None:
            raise ValueError("CPUAdamW: offload_optimizer device \"nvme\" needs an nvme_path")
        return os.fspath(path)

    # ---------------------------------------------------------------- lifetime

    @property
    def nvme_dir(self):
        """The directory holding this optimizer's NVMe states (None in RAM mode or once closed)."""
        return None if self._store is None or self._store.closed else self._store.dir

    def close(self):
        """Frees the CPU optimizer and, in NVMe mode, the engine and its files
        (the optimizer states are gone: take state_dict() first to keep them).
        Idempotent; the optimizer cannot step afterwards."""
        self._closed = True
        store = getattr(self, "_store", None)
        if store is not None:
            store.close()
        self._scratch = None
        h = getattr(self, "_handle", None)
        if h is not None and h.value:
            _lib.strata_cpu_optimizer_destroy(h)
            self._handle = None

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _check_open(self):
        if self._closed:
            raise RuntimeError("CPUAdamW: the optimizer was closed" +
                               (" (its NVMe optimizer states were deleted)" if self._nvme_path else ""))

    # ---------------------------------------------------------------- the update

    def _config(self, group):
        c = _lib.OptimizerConfig()
        kind = _lib.OPT_ADAMW if group.get("decoupled_weight_decay", self._adamw) else _lib.OPT_ADAM
        _lib.check(_lib.strata_optimizer_config_init(kind, ctypes.byref(c)))
        lr = group["lr"]
        c.lr = float(lr.item() if torch.is_tensor(lr) else lr)
        c.beta1, c.beta2 = (float(b) for b in group["betas"])
        c.eps = float(group["eps"])
        c.weight_decay = float(group["weight_decay"])
        c.amsgrad = 1 if group["amsgrad"] else 0
        c.maximize = 1 if group["maximize"] else 0
        c.grad_scale = 1.0
        return c

    def __setstate__(self, state):
        # A state_dict from DeepSpeed's DeepSpeedCPUAdam (or an older torch)
        # has groups without these keys: torch's own optimizers fill them the
        # same way (step() read group["maximize"] and failed with a KeyError).
        # decoupled_weight_decay as torch: AdamW (adamw_mode) forces it on
        # every group it loads, Adam keeps a loaded group's (default off).
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("maximize", False)
            group.setdefault("amsgrad", False)
            if self._adamw:
                group["decoupled_weight_decay"] = True
            else:
                group.setdefault("decoupled_weight_decay", False)

    def __reduce_ex__(self, protocol):
        # torch's optimizers pickle their groups and state; this one's update
        # runs in a native handle (and its NVMe states in an engine's files),
        # which a copy would not have.
        raise TypeError("CPUAdamW cannot be pickled or copied (pickle, copy.deepcopy, torch.save(optimizer)): "
                        "its update runs in Strata's native optimizer" +
                        (" and its states live in NVMe files" if self._nvme_path else "") +
                        "; save optimizer.state_dict() and load it into a new CPUAdamW instead")

    def _group_config(self, gi, group):
        """The group's kernel config, checked on one dummy element before anything changes (a value
        the kernel refuses, from a scheduler or a loaded state_dict, must not stop a step part-way)."""
        if not group.get("bias_correction", True):
            raise ValueError(f"CPUAdamW: param_groups[{gi}] has bias_correction=False, which is not implemented "
                             "(the update always corrects the moments' bias, as torch.optim.AdamW)")
        cfg = self._config(group)
        self._kernel(cfg, 1, torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1),
                     torch.zeros(1) if group["amsgrad"] else None, f"CPUAdamW: param_groups[{gi}] (its hyper-parameters)")
        return cfg

    def _kernel(self, cfg, step, p, g, m, v, mx, where):
        """One strata_cpu_optimizer_step over p (fp32, in place) with states m, v (and mx)."""
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

    @staticmethod
    def _checked(p, where):
        """p's gradient, contiguous, after the checks both modes make."""
        if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
            raise ValueError(f"{where}: must be a contiguous fp32 CPU tensor (the fp32 master), is "
                             f"{'' if p.is_contiguous() else 'a non-contiguous '}{p.dtype} on {p.device}")
        g = p.grad
        if g.is_sparse or g.device.type != "cpu" or g.dtype not in _DTYPES:
            raise ValueError(f"{where}: its gradient must be a dense fp32/bf16/fp16 CPU tensor, is "
                             f"{g.dtype} on {g.device}{' (sparse)' if g.is_sparse else ''}")
        return g.contiguous()

    @torch.no_grad()
    def step(self, closure=None):
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._nvme_path is not None:
            self._step_nvme()
            return loss
        # Every group's hyper-parameters, gradients and loaded states checked
        # before anything changes, as in NVMe mode: an error never leaves
        # earlier groups stepped (a retry would step them twice).
        work = []
        for gi, group in enumerate(self.param_groups):
            live = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
            cfg = self._group_config(gi, group) if live else None
            for i, p in live:
                where = f"CPUAdamW: param_groups[{gi}]['params'][{i}] (shape {tuple(p.shape)})"
                self._checked(p, where)
                work.append((cfg, group, p, where, self._checked_state(self.state[p], p, group, where)))
        for cfg, group, p, where, step in work:
            g = p.grad.contiguous()
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=self._state_dtype, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=self._state_dtype, memory_format=torch.contiguous_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=self._state_dtype,
                                                               memory_format=torch.contiguous_format)
            mx = state.get("max_exp_avg_sq") if group["amsgrad"] else None
            self._kernel(cfg, step, p, g, state["exp_avg"], state["exp_avg_sq"], mx, where)
            _set_step(state, step)
        return loss

    @staticmethod
    def _checked_state(state, p, group, where):
        """The step a parameter's state takes next (1 for an empty one, made at its first step), or a
        ValueError naming what is wrong: a state_dict loaded from elsewhere is checked before any
        parameter moves."""
        if len(state) == 0:
            return 1
        names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        for k in ("step",) + names:
            if k not in state:
                hint = " (a state saved with amsgrad=False?)" if k == "max_exp_avg_sq" else ""
                raise ValueError(f"{where}: its optimizer state has no {k!r}{hint}")
        step = _next_step(state, where)
        for k in names:
            s = state[k]
            if (not torch.is_tensor(s) or s.dtype not in (torch.float32, torch.bfloat16) or s.device.type != "cpu"
                    or not s.is_contiguous() or s.shape != p.shape):
                raise ValueError(f"{where}: optimizer state {k!r} must be a contiguous fp32/bf16 CPU tensor of the "
                                 "parameter's shape (a loaded state_dict from elsewhere?)")
            if s.dtype != state["exp_avg"].dtype:
                raise ValueError(f"{where}: exp_avg and {k} must share a dtype")
        return step

    def add_param_group(self, param_group):
        """torch's add_param_group; a parameter that is not an fp32 CPU tensor, or one listed twice in the
        group, is refused here, not at step()."""
        params = param_group.get("params") if isinstance(param_group, dict) else None
        if params is not None and not torch.is_tensor(params) and not isinstance(params, set):
            params = list(params)
            if len({id(p) for p in params}) != len(params):
                # torch warns that this will be an error, and updates it once per listing.
                raise ValueError("CPUAdamW: a param group lists a parameter more than once (torch warns that "
                                 "this will be an error); list each parameter once")
            param_group = dict(param_group, params=params)
        super().add_param_group(param_group)
        for i, p in enumerate(self.param_groups[-1]["params"]):
            if p.dtype != torch.float32 or p.device.type != "cpu":
                gi = len(self.param_groups) - 1
                self.param_groups.pop()
                raise ValueError(f"CPUAdamW: param_groups[{gi}]['params'][{i}] (shape {tuple(p.shape)}) is {p.dtype} "
                                 f"on {p.device}; CPUAdamW updates fp32 CPU parameters (the fp32 masters): keep "
                                 "fp32 masters and cast copies for compute")

    # ---------------------------------------------------------------- NVMe mode

    def _where(self, p):
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return f"CPUAdamW: param_groups[{gi}]['params'][{i}] (shape {tuple(p.shape)})"
        return f"CPUAdamW: a parameter of shape {tuple(p.shape)}"

    def _layout_key(self):
        """What the store's layout depends on: the parameters in order, their
        sizes, and which keep a max_exp_avg_sq."""
        return tuple((id(p), p.numel(), bool(group["amsgrad"]) or p in self._has_max)
                     for group in self.param_groups for p in group["params"])

    def _build_store(self, carried):
        """A new store laid out for the current param groups, holding `carried`
        ({param: {"exp_avg": t, "exp_avg_sq": t[, "max_exp_avg_sq": t]}}); the
        old store (if any) is closed first."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32 or p.device.type != "cpu":
                    raise ValueError(f"{self._where(p)}: is {p.dtype} on {p.device}; CPUAdamW updates fp32 CPU "
                                     "parameters (the fp32 masters): keep fp32 masters and cast copies for compute")
        if self._store is not None:
            self._store.close()
            self._store = None
        # Engine tensors of at most _BUCKET_ELEMS elements (what the engine and
        # the scratch hold in RAM depends on the largest): a large parameter in
        # pieces of its own, smaller ones packed in order; then a mirror tensor
        # (state 0 = max_exp_avg_sq) of every tensor holding an amsgrad one.
        # slots[p]: [(tensor, offset in it, offset in p, elements)].
        sizes, slots, shadow_needed = [], {}, set()
        bucket = None
        for group in self.param_groups:
            for p in group["params"]:
                n = p.numel()
                if n == 0:
                    continue
                pieces = []
                if n >= _BUCKET_ELEMS:
                    for start in range(0, n, _BUCKET_ELEMS):
                        pieces.append((len(sizes), 0, start, min(_BUCKET_ELEMS, n - start)))
                        sizes.append(pieces[-1][3])
                else:
                    if bucket is None or sizes[bucket] + n > _BUCKET_ELEMS:
                        bucket = len(sizes)
                        sizes.append(0)
                    pieces.append((bucket, sizes[bucket], 0, n))
                    sizes[bucket] += n
                slots[p] = pieces
                if group["amsgrad"] or p in self._has_max:
                    shadow_needed.update(t for t, _, _, _ in pieces)
        names = [f"states{t}" for t in range(len(sizes))]
        shadow = {}
        for t in sorted(shadow_needed):
            shadow[t] = len(sizes)
            sizes.append(sizes[t])
            names.append(f"states{t}.max_exp_avg_sq")
        self._slots, self._shadow = slots, shadow
        self._scratch = None
        self._layout = self._layout_key()
        if not sizes:
            self._store = None
            return
        self._store = _NvmeStore(sizes, names, self._nvme_path, self._state_dtype, self._aio)
        self._write_states(carried)

    def _buffers(self, n, count):
        """fp32 views (and bf16 ones with bf16 states) of `count` scratch arrays of n elements."""
        if self._scratch is None:
            rows, need = 3 if self._shadow else 2, max(self._store.sizes)
            f32 = torch.empty((rows, need), dtype=torch.float32)
            low = torch.empty((rows, need), dtype=torch.bfloat16) if self._state_dtype != torch.float32 else None
            self._scratch = (f32, low)
        f32, low = self._scratch
        return [f32[r, :n] for r in range(count)], ([low[r, :n] for r in range(count)] if low is not None else None)

    def _pieces_by_tensor(self, params):
        """{tensor: [(param, offset in tensor, offset in param, elements)]}, in tensor order."""
        out = collections.defaultdict(list)
        for p in params:
            for t, off, start, n in self._slots.get(p, ()):
                out[t].append((p, off, start, n))
        return dict(sorted(out.items()))

    def _read_moments(self, t, f32, count):
        """Engine tensor t's exp_avg, exp_avg_sq (and max_exp_avg_sq, from its shadow tensor, when count is 3) into f32."""
        self._store.read(t, 0, f32[0])
        self._store.read(t, 1, f32[1])
        if count == 3:
            self._store.read(self._shadow[t], 0, f32[2])

    def _read_states(self, params):
        """{param: {key: new tensor in the state dtype}} read from the store."""
        out = {}
        for p in params:
            keys = _STATE_KEYS + (("max_exp_avg_sq",) if p in self._has_max else ())
            out[p] = {k: torch.zeros(p.shape, dtype=self._state_dtype) for k in keys}
        for t, pieces in self._pieces_by_tensor(params).items():
            count = 3 if any(p in self._has_max for p, _, _, _ in pieces) else 2
            f32, _ = self._buffers(self._store.sizes[t], count)
            self._read_moments(t, f32, count)
            for p, off, start, n in pieces:
                for r, k in enumerate(_STATE_KEYS + ("max_exp_avg_sq",)):
                    if k in out[p]:
                        out[p][k].view(-1)[start:start + n].copy_(f32[r][off:off + n])
        return out

    def _write_states(self, carried):
        """Writes {param: {key: tensor}} into the (new) store; other slices stay zero."""
        for t, pieces in self._pieces_by_tensor(carried).items():
            count = 3 if t in self._shadow and any("max_exp_avg_sq" in carried[p] for p, _, _, _ in pieces) else 2
            f32, _ = self._buffers(self._store.sizes[t], count)
            for a in f32:
                a.zero_()
            for p, off, start, n in pieces:
                for r, k in enumerate(_STATE_KEYS + ("max_exp_avg_sq",)[:count]):
                    if k in carried[p]:
                        f32[r][off:off + n].copy_(carried[p][k].reshape(-1)[start:start + n])
            self._store.write(t, 0, f32[0])
            self._store.write(t, 1, f32[1])
            if count == 3:
                self._store.write(self._shadow[t], 0, f32[2])

    def _step_nvme(self):
        # The layout follows the param groups: a parameter added
        # (add_param_group, or appended to a group's list) or a group's amsgrad
        # turned on for parameters without state rebuilds the store, carrying
        # every state over.
        for gi, group in enumerate(self.param_groups):
            if not group["amsgrad"]:
                continue
            for i, p in enumerate(group["params"]):
                if p.grad is not None and len(self.state[p]) > 0 and p not in self._has_max:
                    raise ValueError(f"CPUAdamW: param_groups[{gi}]['params'][{i}] (shape {tuple(p.shape)}): "
                                     "amsgrad is on but its state has no max_exp_avg_sq (amsgrad was off when "
                                     "its state began; torch.optim.AdamW fails here too)")
        if self._layout_key() != self._layout:
            known = []
            for p, pieces in self._slots.items():
                if len(self.state.get(p, {})) == 0:
                    continue
                n = sum(piece[3] for piece in pieces)
                if p.numel() != n:
                    raise ValueError(f"{self._where(p)}: has {p.numel()} elements, its optimizer state {n} (the "
                                     "parameter was resized after its first step)")
                known.append(p)
            self._build_store(self._read_states(known))
        # Everything is checked before anything changes: the parameters and
        # gradients, and each group's hyper-parameters (the kernel on one dummy
        # element), so a step stops part-way only on an I/O error.
        todo = []  # (p, flat p, flat g, state, cfg, amsgrad, where, step)
        for gi, group in enumerate(self.param_groups):
            cfg = None
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                where = f"CPUAdamW: param_groups[{gi}]['params'][{i}] (shape {tuple(p.shape)})"
                g = self._checked(p, where)
                if cfg is None:
                    cfg = self._group_config(gi, group)
                state = self.state[p]
                if "exp_avg" in state:
                    raise ValueError(f"{where}: its state holds exp_avg tensors in NVMe mode (set by hand?); "
                                     "load states with load_state_dict")
                fresh = len(state) == 0
                todo.append((p, p.detach().view(-1), g.view(-1), state, cfg, bool(group["amsgrad"]), where,
                             1 if fresh else _next_step(state, where), fresh))
        left = collections.Counter()  # pieces of each param not yet updated and written
        by_tensor = collections.defaultdict(list)
        for job in todo:
            for t, off, start, n in self._slots.get(job[0], ()):
                by_tensor[t].append((job, off, start, n))
                left[id(job[0])] += 1
        def finish(job):  # its moments are written: its step moves
            p, _, _, state, _, amsgrad, _, step, fresh = job
            _set_step(state, step)
            if fresh and amsgrad:
                self._has_max.add(p)

        try:
            for t in sorted(by_tensor):
                self._update_tensor(t, by_tensor[t], left)
        except BaseException as e:
            for job in todo:
                if left[id(job[0])] == 0:
                    finish(job)
            part = [job[6] for job in todo if 0 < left[id(job[0])] < len(self._slots[job[0]])]
            if part and isinstance(e, StrataError):
                msg, tag = str(e), f" [{e.status}]"
                raise StrataError(e.status, f"{msg[:-len(tag)] if msg.endswith(tag) else msg}; this step stopped "
                                            f"part-way: {', '.join(part)} updated in part (their state and step "
                                            "are not)") from e
            raise
        for job in todo:
            finish(job)

    def _update_tensor(self, t, pieces, left):
        """Reads engine tensor t's moments, updates the pieces of parameters
        with a gradient it holds, writes the moments back."""
        count = 3 if any(job[5] for job, _, _, _ in pieces) else 2
        f32, low = self._buffers(self._store.sizes[t], count)
        self._read_moments(t, f32, count)
        for job, off, _, n in pieces:
            if job[8]:  # the parameter's first step: zero moments whatever the store holds
                for r in range(count):
                    f32[r][off:off + n].zero_()
        arrays = f32
        if low is not None:
            for r in range(count):
                low[r].copy_(f32[r])
            arrays = low
        done = []
        try:
            for job, off, start, n in pieces:
                _, p, g, _, cfg, amsgrad, where, step, _ = job
                self._kernel(cfg, step, p[start:start + n], g[start:start + n], arrays[0][off:off + n],
                             arrays[1][off:off + n], arrays[2][off:off + n] if amsgrad else None, where)
                done.append(job)
        finally:
            # The updates made (all, unless something failed) go to NVMe
            # before anything is raised.
            if done:
                if low is not None:
                    for r in range(count):
                        f32[r].copy_(low[r])
                try:
                    self._store.write(t, 0, f32[0])
                    self._store.write(t, 1, f32[1])
                    if count == 3:
                        self._store.write(self._shadow[t], 0, f32[2])
                except StrataError as e:
                    names = ", ".join(sorted({job[6] for job in done}))
                    msg, tag = str(e), f" [{e.status}]"
                    raise StrataError(e.status, f"{names}: updated, but their optimizer state could not be "
                                                f"written to NVMe (it is now older than the weights): "
                                                f"{msg[:-len(tag)] if msg.endswith(tag) else msg}") from e
                for job in done:
                    left[id(job[0])] -= 1

    # ---------------------------------------------------------------- state dicts

    def state_dict(self):
        """torch.optim.AdamW's layout in both modes (NVMe mode: the moments are
        read from NVMe into new CPU tensors of the state dtype; the
        register_state_dict_post_hook hooks see them, as in RAM mode)."""
        if self._nvme_path is None:
            return super().state_dict()
        with _hooks_held(self, "_optimizer_state_dict_post_hooks") as post_hooks:
            sd = super().state_dict()
        self._check_open()
        index = {}
        for packed, group in zip(sd["param_groups"], self.param_groups):
            for idx, p in zip(packed["params"], group["params"]):
                index[idx] = p
        with_state = [index[idx] for idx in sd["state"]]
        states = self._read_states(with_state)
        out = {}
        for idx, st in sd["state"].items():
            # A snapshot: the moments are copies, so the step is too (torch's
            # state_dict shares tensors that later steps change in place).
            st = {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
            st.update(states[index[idx]])
            out[idx] = st
        sd["state"] = out
        for hook in post_hooks:
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict):
        """torch.optim.AdamW's layout (from torch, this class in either mode):
        param groups and per-parameter state, moved to RAM or NVMe. The
        load_state_dict pre- and post-hooks run as in torch: the pre-hooks
        before the dict is checked, the post-hooks once the state is in place."""
        self._check_open()
        if self._nvme_path is not None:
            with _hooks_held(self, "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks") \
                    as (pre_hooks, post_hooks):
                # The pre-hooks see (and may replace) a copy of the dict before it is checked, as in torch.
                state_dict = state_dict.copy()
                for hook in pre_hooks:
                    result = hook(self, state_dict)
                    if result is not None:
                        state_dict = result
                self._load_nvme(state_dict)
            for hook in post_hooks:
                hook(self)
            return
        with _hooks_held(self, "_optimizer_load_state_dict_post_hooks") as post_hooks:
            super().load_state_dict(state_dict)
        # torch casts states to the parameter's dtype: keep the configured one.
        for state in self.state.values():
            for k in _STATE_KEYS + ("max_exp_avg_sq",):
                # (and as torch steps a channels_last state, so does this: contiguous)
                if k in state and torch.is_tensor(state[k]) and (state[k].dtype != self._state_dtype
                                                                 or not state[k].is_contiguous()):
                    state[k] = state[k].to(self._state_dtype).contiguous()
        for hook in post_hooks:  # on the state as it will step
            hook(self)

    def _load_nvme(self, state_dict):
        """load_state_dict in NVMe mode (its hooks held by the caller)."""
        # Checked before anything changes: torch's load replaces the groups and state.
        for packed, group in zip(state_dict.get("param_groups", ()), self.param_groups):
            for idx, p in zip(packed["params"], group["params"]):
                st = state_dict.get("state", {}).get(idx)
                if not st:
                    continue
                where = self._where(p)
                if "step" not in st or any(k not in st for k in _STATE_KEYS):
                    raise ValueError(f"{where}: the loaded state has keys {sorted(st)}, not step, exp_avg and "
                                     "exp_avg_sq (not an Adam/AdamW state dict?)")
                _next_step(st, where + ": the loaded state")
                for k in _STATE_KEYS + ("max_exp_avg_sq",):
                    val = st.get(k)
                    if val is not None and (not torch.is_tensor(val) or val.numel() != p.numel()):
                        raise ValueError(f"{where}: the loaded state {k!r} has "
                                         f"{val.numel() if torch.is_tensor(val) else type(val).__name__} "
                                         f"elements, the parameter {p.numel()}")
        super().load_state_dict(state_dict)
        carried = {}
        for p, state in self.state.items():
            moved = {k: state.pop(k) for k in _STATE_KEYS + ("max_exp_avg_sq",) if k in state}
            if moved:
                carried[p] = moved
            if "step" in state:  # not the caller's tensor, which later steps would change
                state["step"] = torch.tensor(float(_step_of(state)), dtype=torch.float32)
        self._has_max = {p for p, moved in carried.items() if "max_exp_avg_sq" in moved}
        self._build_store(carried)


class DeepSpeedCPUAdam(CPUAdamW):
    """CPUAdamW with DeepSpeedCPUAdam's signature and defaults (deepspeed.ops.adam.DeepSpeedCPUAdam, 0.19):
    bias_correction second, weight_decay 0 (torch.optim.AdamW's, which CPUAdamW keeps, is 0.01), so code
    written for DeepSpeed's class gets the same update. fp32_optimizer_states=False keeps DeepSpeed's
    meaning, moments in the parameters' dtype: fp32 here, as parameters are fp32 (CPUAdamW's own
    fp32_optimizer_states=False means bf16 moments). The keyword-only options of CPUAdamW (nvme_path=,
    offload_optimizer=, aio=, threads=, maximize=) are taken too."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True, **kwargs):
        del fp32_optimizer_states  # the parameters' dtype, fp32, either way (see above)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         adamw_mode=adamw_mode, bias_correction=bias_correction, fp32_optimizer_states=True,
                         **kwargs)

    def __setstate__(self, state):
        # DeepSpeed's class reads adamw_mode alone: a loaded group's
        # decoupled_weight_decay (a torch state dict's) does not change it.
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = self._adamw
