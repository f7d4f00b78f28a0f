"""strata.torch.initialize: a torch model's training state in Strata's engine,
driven by module hooks the way DeepSpeed ZeRO-3 (parameter_offload.py) and
FSDP2 do it.

- Every parameter lives in the engine (fp32 master, AdamW state and fp32
  gradient accumulator on the tiers the config places them: host RAM or NVMe;
  the compute copy in the compute dtype). Between uses, `param.data` is a
  one-element placeholder expanded to the parameter's shape (no memory).
- Parameters are grouped by the module that owns them (the first module, in
  named_modules order, whose _parameters hold them: a tied weight belongs to
  its first owner). Before a module's forward its groups are acquired and
  `param.data` views the engine's buffer (no copy); after it they are
  released.
- Autograd keeps what the backward needs (weight.t(), ...): a
  saved_tensors_hooks pair replaces every saved view of an engine buffer by a
  token and rebuilds it in backward from a fresh acquire, so a released and
  reused slot is never read (issue 12's silently wrong 2.873 vs 3.075).
- Each trainable parameter's gradient goes to the engine once accumulated
  (register_post_accumulate_grad_hook) and the torch-side gradient is freed.
- engine.step() at each gradient-accumulation boundary runs Strata's step
  (clipping, AdamW, fp16 loss scaling) with the learning rates of the returned
  optimizer's param_groups, which a torch lr_scheduler may drive.

Devices: a model on the CPU gets the host backend (the engine's "device" is
RAM); a model on one GPU (cuda:N) the CUDA backend on that GPU (the GPU path
never ran on a GPU yet: unverified). On CUDA:
- Streams: the engine orders its work against PyTorch's current stream
  (wrapped with strata_stream_wrap, one wrapper per stream, cached). An
  acquire makes that stream wait for the upload (no host synchronize); a
  release lets the buffer be reused once that stream passed it. The stream
  may change between uses (torch.cuda.stream around a whole micro-batch)
  while no group is held; a different current stream while groups are held
  is refused by name (its work would not be ordered against theirs).
- Threads: backward hooks run on PyTorch's autograd thread for the device;
  every driving call goes through one lock (the C ABI's driving calls must
  never overlap) with the engine's device current (the C library sets the
  calling thread's CUDA device; torch.cuda.device restores the caller's).
- Memory: the engine's device budget is "strata.device_memory" when the
  config gives it, else "strata.device_memory_fraction" (default
  DEVICE_MEMORY_FRACTION) of the GPU memory free at initialize(); the rest
  is PyTorch's (activations, workspaces, gradients before the engine takes
  them). "strata.device_reserve" defaults to 0 here: the engine's reserve is
  for activations of Strata's own trainer, and torch's live outside the
  engine's budget.
"""
import atexit
import base64
import collections
import contextlib
import ctypes
import errno
import functools
import json
import math
import os
import sys
import threading
import warnings
import weakref

import torch
import torch.utils.dlpack

from .. import _lib
from .._lib import StrataError
from . import lr_schedules

_DTYPES = {torch.float32: _lib.DTYPE_F32, torch.bfloat16: _lib.DTYPE_BF16, torch.float16: _lib.DTYPE_F16}
# DeepSpeed config keys this package handles itself or that do not change the
# math (the rest goes to the engine, whose parser reads or refuses every key).
_PACKAGE_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "scheduler"}
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Param group entries the engine takes once, at initialize().
_FIXED_GROUP_KEYS = ("weight_decay", "eps", "amsgrad", "maximize")


class _CallableInt(int):
    """An int that DeepSpeed's engine API calls as a method: engine.train_batch_size() and
    engine.train_batch_size both give the number."""

    def __call__(self):
        return int(self)


def _launch_world(mpi_comm):
    """The data-parallel world size as the launch tells it before the engine exists."""
    if mpi_comm is not None and hasattr(mpi_comm, "Get_size"):
        return int(mpi_comm.Get_size())
    for key in ("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE"):
        v = os.environ.get(key, "")
        if v.isdigit() and int(v) > 0:
            return int(v)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _batch_sizes(given, world):
    """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps) as DeepSpeed derives
    them (runtime/config.py _set_batch_related_parameters, _batch_assertion): two given fix the third, one
    of the batch sizes alone means no accumulation, and all three must agree with the world size. Unlike
    DeepSpeed, giving neither batch size is allowed (the micro-batch is whatever the caller feeds):
    gradient_accumulation_steps, default 1, and None for the other two."""
    vals = {}
    for key in _BATCH_KEYS:
        v = given.get(key)
        if v == "auto":
            raise ValueError(f"strata.torch.initialize: config {key} is \"auto\", the Hugging Face Trainer's "
                             "placeholder: give a number (StrataTrainer fills it from TrainingArguments)")
        # An integral float (12.0, 1e3) is the integer, as DeepSpeed's config and the C++ parser take it.
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"strata.torch.initialize: config {key} is {v!r}; it must be an integer >= 1")
        vals[key] = v
    tb, mb, gas = (vals[k] for k in _BATCH_KEYS)
    if tb is not None and mb is not None and gas is None:
        gas = tb // mb // world
    elif tb is not None and gas is not None and mb is None:
        mb = tb // world // gas
    elif mb is not None and gas is not None and tb is None:
        tb = mb * gas * world
    elif tb is not None and mb is None and gas is None:
        gas, mb = 1, tb // world
    elif mb is not None and tb is None and gas is None:
        gas, tb = 1, mb * world
    elif tb is None and mb is None:
        return None, None, gas or 1
    if min(tb, mb, gas) < 1 or tb != mb * gas * world:
        raise ValueError(f"strata.torch.initialize: the config's batch sizes do not agree (as DeepSpeed checks): "
                         f"train_batch_size {tb} != train_micro_batch_size_per_gpu {mb} * "
                         f"gradient_accumulation_steps {gas} * world size {world}")
    return tb, mb, gas


# A model on a GPU whose config gives no strata.device_memory: the engine's
# device budget is this share of the GPU memory free when initialize() runs
# (config: strata.device_memory_fraction); the rest stays PyTorch's.
DEVICE_MEMORY_FRACTION = 0.5


class _EngineParameter(torch.nn.Parameter):
    """The class of every parameter an engine holds (the parameter objects are
    the model's own: initialize() changes their class, nothing else). Between
    uses `.data` is a placeholder with no values, so any torch function or
    method that would read it raises StrataError naming the parameter, in
    every mode (training, torch.no_grad() evaluation); what reads only
    metadata (shape, dtype, device, numel(), requires_grad, hashing, ...) and
    a conversion that is a no-op (`model.to(its own device)`) still work."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            empty = None
            for a in args:
                if type(a) is _EngineParameter and a.data_ptr() == a._strata_placeholder:
                    empty = a
                    break
                if isinstance(a, (list, tuple)):  # torch.cat([w1, w2]), ...
                    empty = next((b for b in a if type(b) is _EngineParameter
                                  and b.data_ptr() == b._strata_placeholder), None)
                    if empty is not None:
                        break
            if empty is None:
                return func(*args, **kwargs)
            kind, name = _op_name(func)
            if kind == "set" or (kind == "get" and name not in _VALUE_GETTERS) or (kind == "call" and name in _METADATA):
                return func(*args, **kwargs)
            if kind == "call" and name in _CONVERSIONS:
                out = func(*args, **kwargs)
                if out is empty or not isinstance(out, torch.Tensor):
                    return out
        engine = empty._strata_engine()
        what = f"torch function {name}" if kind == "call" else f"attribute .{name}"
        if engine is None or getattr(engine, "_e", None) is None:
            raise StrataError(1, f"strata.torch: parameter {empty._strata_name} was used ({what}) after its engine "
                                 "was destroyed: its values went with the engine (read them before destroy(), with "
                                 "engine.state_dict())")
        raise StrataError(1, engine._outside_message(empty, what))

    def __repr__(self):
        with torch._C.DisableTorchFunctionSubclass():
            if self.data_ptr() == self._strata_placeholder:
                return (f"Parameter {self._strata_name} (held by strata.torch: shape {tuple(self.shape)}, "
                        f"{self.dtype}, {self.device}; read it with engine.parameter_fp32)")
        return super().__repr__()


# What may touch a parameter between uses (placeholder): property getters but
# those that expose values, metadata methods, and conversions that are no-ops.
_VALUE_GETTERS = {"data", "T", "mT", "H", "mH", "real", "imag"}
_METADATA = {"size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "is_contiguous",
             "stride", "get_device", "data_ptr", "requires_grad_", "register_hook",
             "register_post_accumulate_grad_hook", "__hash__", "__len__", "__repr__", "__format__",
             "_has_compatible_shallow_copy_type"}
_CONVERSIONS = {"to", "cuda", "cpu", "float", "half", "bfloat16", "double", "type"}


def _op_name(func):
    """("get" | "set" | "call", name) of what __torch_function__ was handed."""
    name = getattr(func, "__name__", "") or repr(func)
    if name in ("__get__", "__set__", "__delete__"):
        return ("get" if name == "__get__" else "set"), getattr(getattr(func, "__self__", None), "__name__", "")
    return "call", name


def _driven(method):
    """The method runs inside the engine's _driving() context (its lock, and on CUDA its device)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._driving():
            return method(self, *args, **kwargs)
    return run


_CHECKSUM_CHUNK = 1 << 22
_checksum_weights = None


def _checksum(t):
    """Two sums of a tensor's fp32 bytes read as int32 words, taken mod 2^64: a plain one and one weighted
    by fixed odd multipliers per position (and per 16 MiB chunk): equal tensors give equal sums on every
    rank, and tensors that differ (another random init) differ in them but with chance ~2^-64. Not a
    cryptographic hash: it tells ranks apart, not adversaries."""
    global _checksum_weights
    if _checksum_weights is None:
        g = torch.Generator().manual_seed(0x5eed5)
        _checksum_weights = torch.randint(-2 ** 31, 2 ** 31 - 1, (_CHECKSUM_CHUNK,), dtype=torch.int32,
                                          generator=g) | 1
    v = t.detach().to(device="cpu", dtype=torch.float32).contiguous().reshape(-1).view(torch.int32)
    plain = weighted = 0
    for i in range(0, v.numel(), _CHECKSUM_CHUNK):
        c = v[i:i + _CHECKSUM_CHUNK]
        plain += int(c.sum(dtype=torch.int64))
        # int32 products wrap, which is as good a mix and stays exact on every rank.
        weighted = weighted * 1000003 + int((c * _checksum_weights[:c.numel()]).sum(dtype=torch.int64))
    return [((x + 2 ** 63) % 2 ** 64) - 2 ** 63 for x in (plain, weighted)]


def _is_cuda(device):
    return device.type == "cuda"


def _model_device(model):
    """The one device all the model's parameters are on (the CPU for a model without any)."""
    first = None
    for n, p in model.named_parameters():
        if first is None:
            first = (n, p.device)
        elif p.device != first[1]:
            raise ValueError(f"strata.torch: parameter {n} is on {p.device} and {first[0]} on {first[1]}: the engine "
                             "runs on one device; move the whole model to it (model.to(...)) before initialize()")
    if first is None:
        return torch.device("cpu")
    if first[1].type not in ("cpu", "cuda"):
        raise NotImplementedError(f"strata.torch: parameter {first[0]} is on {first[1]}: the engine runs on the CPU "
                                  "or on one CUDA GPU")
    return first[1]


def _strip_json_comments(text):
    """`text` with its // and /* */ comments (outside strings) replaced by
    spaces, newlines kept: DeepSpeed reads configs with hjson, which allows
    them, and so does the CLI's parser. (hjson's # comments and trailing
    commas are not taken: a syntax error naming the file, as in the CLI.)
    Line and column numbers stay right."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise ValueError("a /* comment is never closed")
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j + 2]))
            i = j + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _no_duplicate_keys(pairs):
    # As DeepSpeed refuses them ("Duplicate keys in DeepSpeed config"): with
    # plain json the last one would win without a word.
    seen, dups = {}, []
    for k, v in pairs:
        if k in seen and k not in dups:
            dups.append(k)
        seen[k] = v
    if dups:
        raise ValueError(f"duplicate keys {dups} in one object")
    return seen


def _load_config(config):
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            text = f.read()
        try:
            return json.loads(_strip_json_comments(text), object_pairs_hook=_no_duplicate_keys)
        except ValueError as e:  # json.JSONDecodeError is one
            raise ValueError(f"strata.torch.initialize: config file {os.fspath(config)}: {e}") from None
    if isinstance(config, dict):
        return json.loads(json.dumps(config))  # a deep copy, JSON-clean
    raise TypeError(f"strata.torch.initialize: config must be a dict or a path, not {type(config).__name__}")


class _Saved:
    """What a saved view of an engine buffer becomes while autograd holds it."""
    __slots__ = ("pid", "size", "stride", "offset")

    def __init__(self, pid, t):
        self.pid, self.size, self.stride, self.offset = pid, t.size(), t.stride(), t.storage_offset()


class _Optimizer(torch.optim.Optimizer):
    """The optimizer initialize() returns: its param_groups carry the
    hyper-parameters a torch lr_scheduler changes (lr); the update itself is
    Strata's (engine.step()). step() after the engine's step (the Hugging Face
    Trainer calls both) does nothing; in place of it, with micro-batches
    backward took and engine.step() did not, it is refused (a torch loop's
    optimizer.step() would otherwise update nothing). zero_grad() is
    DeepSpeed's ZeRO optimizer's: the micro-batches backward took since the
    last step are dropped when the next one begins (its forward), the
    accumulation window counting on; a step() before that applies them."""

    def __init__(self, groups, defaults):
        super().__init__(groups, defaults)
        self._engine = None  # a weakref.ref to the engine, set by it
        self._engine_step = None  # set by engine.step() while its update runs inside step()

    def step(self, closure=None):  # noqa: D102 - the engine steps
        if closure is not None:
            raise TypeError("strata.torch: optimizer.step(closure): the engine takes no closure (its update uses "
                            "the gradients engine.backward(loss) gave; DeepSpeed's ZeRO optimizers ignore one): "
                            "call the closure's forward and engine.backward(loss) yourself, then engine.step()")
        if self._engine_step is not None:
            return self._hooked(self._engine_step)
        e = self._engine() if self._engine is not None else None
        if e is not None and e._outside_grads:
            e._abandon()
            raise StrataError(1, "strata.torch: optimizer.step() after loss.backward(): the engine takes the "
                                 "gradients through engine.backward(loss) and steps in engine.step(); the "
                                 "micro-batch was discarded")
        if e is not None and e._micro > 0:
            raise StrataError(1, f"strata.torch: optimizer.step() with {e._micro} micro-batch(es) from "
                                 "engine.backward() not stepped: the update is the engine's, call engine.step() "
                                 "(it steps at the accumulation boundary)")
        return None

    # torch wraps an Optimizer's step() to run the step hooks around every
    # call; here they run around the engine's update only (_hooked), not
    # around the call that does nothing after it (the Hugging Face Trainer
    # makes one per step).
    step.hooked = True

    def _hooked(self, update):
        """update() between the step pre-hooks (torch's global ones, then this optimizer's) and the post-hooks
        (this optimizer's, then the global ones), called as torch's step() wrapper calls them."""
        from torch.optim import optimizer as torch_optimizer
        args, kwargs = (self,), {}
        for hook in (list(getattr(torch_optimizer, "_global_optimizer_pre_hooks", {}).values())
                     + list(self._optimizer_step_pre_hooks.values())):
            hook(self, args, kwargs)
        out = update()
        for hook in (list(self._optimizer_step_post_hooks.values())
                     + list(getattr(torch_optimizer, "_global_optimizer_post_hooks", {}).values())):
            hook(self, args, kwargs)
        return out

    def zero_grad(self, set_to_none=True):  # noqa: D102 - the engine owns the gradients
        e = self._engine() if self._engine is not None else None
        if e is not None:
            e._zero_pending = e._micro > 0
        return None

    # The AdamW state lives in the engine: torch's state_dict holds no moments
    # here, and moments loaded here would never reach the engine. accelerate
    # (the Hugging Face Trainer) round-trips the state_dict at prepare(): an
    # empty state loads (the param groups, as torch), StrataTrainer silences
    # the warning.
    _quiet_state_dict = False

    def state_dict(self):  # noqa: D102
        if not self._quiet_state_dict:
            warnings.warn("strata.torch: optimizer.state_dict() holds the param groups but no AdamW moments: they "
                          "live in the engine (engine.save_checkpoint(dir) / load_checkpoint(dir) save and restore "
                          "them with the weights; engine.optimizer_state(name) reads one parameter's)", stacklevel=2)
        return super().state_dict()

    def load_state_dict(self, state_dict):  # noqa: D102
        if state_dict.get("state"):
            raise NotImplementedError("strata.torch: optimizer.load_state_dict() with optimizer state (moments): "
                                      "it would never reach the engine, where the state lives; restore it with "
                                      "engine.load_checkpoint(dir)")
        return super().load_state_dict(state_dict)


def _group_ranks():
    """The ranks of torch.distributed's default process group, made without
    the launcher's environment (RANK, WORLD_SIZE unset: processes started by
    torch.multiprocessing.spawn or the trainer's own launcher, with
    init_process_group(rank=, world_size=)): (rank, world size, the address
    and port of the group's TCPStore, where the engine's ranks meet under
    keys of their own). A group whose store is not a TCPStore (file://) is
    refused by name."""
    from torch.distributed import distributed_c10d
    store = distributed_c10d._get_default_store()
    while isinstance(store, torch.distributed.PrefixStore):
        store = store.underlying_store
    world = torch.distributed.get_world_size()
    if not isinstance(store, torch.distributed.TCPStore):
        raise NotImplementedError(
            f"strata.torch.initialize: torch.distributed has a process group of {world} ranks whose store is a "
            f"{type(store).__name__}; the engine's ranks meet through a TCPStore: make the group with "
            "init_method=\"tcp://HOST:PORT\" or env:// (MASTER_ADDR, MASTER_PORT), or launch with torchrun")
    return torch.distributed.get_rank(), world, store.host, store.port


def _comm_timeout_s():
    """How long the ranks' meeting and each collective may wait for a rank
    that stops taking part, in seconds, as DeepSpeed decides its process
    group's timeout: the timeout of torch.distributed's default process
    group where one exists (init_process_group(timeout=),
    deepspeed.init_distributed(timeout=); transformers' TrainingArguments
    ddp_timeout), otherwise DEEPSPEED_TIMEOUT minutes, 10 by default
    (deepspeed.constants.default_pg_timeout). One rank: never waits."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from torch.distributed import distributed_c10d
        group = distributed_c10d._get_default_group()
        for dev in ("cpu", "cuda"):
            try:
                t = group._get_backend(torch.device(dev)).options._timeout
            except (AttributeError, RuntimeError, ValueError):
                continue
            if t.total_seconds() > 0:
                return min(t.total_seconds(), 1e7)  # (the C ABI's most: 115 days)
        store_timeout = getattr(distributed_c10d._get_default_store(), "timeout", None)
        if store_timeout is not None and store_timeout.total_seconds() > 0:
            return min(store_timeout.total_seconds(), 1e7)
    text = os.environ.get("DEEPSPEED_TIMEOUT", "")
    if text == "":
        return 600.0
    try:
        minutes = int(text)
    except ValueError:
        raise ValueError(f"strata.torch.initialize: DEEPSPEED_TIMEOUT={text!r} is not a whole number of minutes "
                         "(DeepSpeed's unit)") from None
    if not 0 < minutes <= 100000:
        raise ValueError(f"strata.torch.initialize: DEEPSPEED_TIMEOUT={text!r} must be 1 to 100000 minutes")
    return minutes * 60.0


def _ranks(mpi_comm, cuda):
    """How this process meets the other data-parallel ranks: (comm_kind,
    Fortran handle, given ranks or None). A model on a GPU under a launcher
    with several ranks (torchrun style: WORLD_SIZE > 1; or mpirun) is one GPU
    rank over NCCL. A CPU model under mpirun (OMPI_COMM_WORLD_SIZE > 1) or
    with mpi_comm= (an mpi4py communicator or its Fortran handle,
    comm.py2f()) is one rank of an MPI job; under a torchrun-style launcher
    (RANK, WORLD_SIZE > 1, MASTER_ADDR, MASTER_PORT: torchrun, or
    torch.distributed's env://) one rank over TCP, meeting the others through
    the TCPStore at MASTER_PORT. Without either, a torch.distributed default
    process group of several ranks gives the ranks (_group_ranks: rank, world
    size, its TCPStore): CPU models over TCP, GPU models over NCCL
    (docs/python.md "Ranks"), also where the environment has WORLD_SIZE but
    no RANK (a spawning parent exported it); otherwise one rank. A launch the package cannot
    join is refused by name: each process would otherwise train alone on its
    own data."""
    if mpi_comm is not None:
        handle = mpi_comm.py2f() if hasattr(mpi_comm, "py2f") else mpi_comm
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise TypeError("strata.torch.initialize: mpi_comm must be an mpi4py communicator or its Fortran "
                            f"handle (comm.py2f()), not {type(mpi_comm).__name__}")
    else:
        handle = None
    world = os.environ.get("OMPI_COMM_WORLD_SIZE", "")
    under_mpirun = world.isdigit() and int(world) > 1
    torchrun = os.environ.get("WORLD_SIZE", "")
    under_torchrun = torchrun.isdigit() and int(torchrun) > 1
    if (under_torchrun and not os.environ.get("RANK") and handle is None and not under_mpirun and
            torch.distributed.is_available() and torch.distributed.is_initialized() and
            torch.distributed.get_world_size() == int(torchrun)):
        # WORLD_SIZE without RANK, beside a process group of that size: a
        # parent that exported WORLD_SIZE (and MASTER_*) to processes it
        # started itself (torch.multiprocessing.spawn), each making its group
        # with rank=. The group has the ranks, as DeepSpeed takes them.
        under_torchrun = False
    if cuda and (under_mpirun or under_torchrun):
        if handle is not None:
            raise NotImplementedError(
                "strata.torch.initialize: mpi_comm= with a model on a GPU: GPU ranks meet over NCCL, bootstrapped "
                "from the launcher's environment (torchrun or mpirun); mpi_comm= is for CPU models")
        return _lib.COMM_NCCL, -1, None
    if handle is None and not under_mpirun:
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        dist_world = torch.distributed.get_world_size() if dist else 1
        if under_torchrun:
            # The engine reads RANK, MASTER_ADDR and MASTER_PORT itself and
            # names what is missing or malformed.
            if dist_world not in (1, int(torchrun)):
                raise ValueError(
                    f"strata.torch.initialize: WORLD_SIZE={torchrun} but the torch.distributed process group has "
                    f"{dist_world} ranks; the engine's ranks are the launcher's (RANK, WORLD_SIZE)")
            return _lib.COMM_TCP, -1, None
        if dist_world > 1:
            return (_lib.COMM_NCCL if cuda else _lib.COMM_TCP), -1, _group_ranks()
        return _lib.COMM_NONE, -1, None
    if cuda:
        raise NotImplementedError(
            "strata.torch.initialize: mpi_comm= with a model on a GPU: GPU ranks meet over NCCL, bootstrapped "
            "from the launcher's environment (torchrun or mpirun); mpi_comm= is for CPU models")
    return _lib.COMM_MPI, (-1 if handle is None else handle), None


class StrataEngine:
    """The object initialize() returns (DeepSpeed's engine API): call it like
    the model, then backward(loss), step(); state_dict(), save_pretrained(),
    save_checkpoint(), load_checkpoint()."""

    def __init__(self, model, model_parameters, config, lr_scheduler=None, mpi_comm=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError("strata.torch.initialize: model must be a torch.nn.Module")
        self.device = _model_device(model)
        self._cuda = _is_cuda(self.device)
        comm_kind, comm_handle, given_ranks = _ranks(mpi_comm, self._cuda)
        self._dev_type = self.device.type  # saved tensors of this device type may view engine buffers
        self._lock = threading.RLock()     # driving calls never overlap (backward hooks: autograd's thread)
        self._wrapped = {}                 # CUDA: native stream handle -> (strata stream, torch stream)
        self._active = None                # CUDA: the native stream of self._s
        cfg = _load_config(config)
        if "scheduler" in cfg and lr_scheduler is not None:
            raise ValueError("strata.torch.initialize: both the config's \"scheduler\" section and lr_scheduler= "
                             "are given; keep one (DeepSpeed would silently use lr_scheduler=)")
        self.module = model
        self._cfg_batch = {k: cfg.get(k) for k in _BATCH_KEYS}
        self.gradient_accumulation_steps = _batch_sizes(self._cfg_batch, _launch_world(mpi_comm))[2]
        self.compute_dtype = _precision(cfg)
        _check_finite(cfg, "config")
        self._auto_cast = _auto_cast(cfg)
        opt_cfg = cfg.get("optimizer", {})
        opt_params = opt_cfg.get("params", {}) if isinstance(opt_cfg, dict) else None
        for where, value in (("optimizer", opt_cfg), ("optimizer.params", opt_params)):
            if value is not None and not isinstance(value, dict):
                # "auto" stands for a value, never a section (DeepSpeed fails on it too).
                raise ValueError(f"strata.torch.initialize: config {where} is {value!r}; expected an object")
        opt_params = opt_params or {}
        base_lr = _opt_number(opt_params, "lr", 1e-3)
        base_wd = _opt_number(opt_params, "weight_decay", 0.0)
        base_eps = _opt_number(opt_params, "eps", 1e-8)
        engine_cfg = {k: v for k, v in cfg.items() if k not in _PACKAGE_KEYS}
        if isinstance(engine_cfg.get("fp16"), dict) and "auto_cast" in engine_cfg["fp16"]:  # forward() does it
            engine_cfg["fp16"] = {k: v for k, v in engine_cfg["fp16"].items() if k != "auto_cast"}
        engine_cfg["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        # Backward holds up to two groups (one autograd node's weights, and
        # the next node's), so the device buffers are planned for two.
        engine_cfg["strata"] = dict(engine_cfg.get("strata", {}))
        engine_cfg["strata"].setdefault("held_groups", 2)
        # DeepSpeed's convention: backward() scales the loss by
        # 1/gradient_accumulation_steps and the step sums the micro-batches'
        # gradients (so a window cut short by set_gradient_accumulation_boundary
        # gives what DeepSpeed gives).
        if "average_micro_batches" in engine_cfg["strata"]:
            raise ValueError("strata.torch: \"strata.average_micro_batches\" is set by the package (DeepSpeed's "
                             "convention: backward() divides the loss by gradient_accumulation_steps)")
        engine_cfg["strata"]["average_micro_batches"] = False
        self.device_memory = self._device_budget(engine_cfg["strata"])

        # Parameter groups (torch's param_groups: lr, weight_decay per group).
        named = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        if model_parameters is None:
            model_parameters = [p for p in model.parameters()]
        groups = list(model_parameters)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self._lr_group, self._decay = {}, {}
        opt_groups = []
        for gi, g in enumerate(groups):
            params = list(g["params"])
            if len({id(p) for p in params}) != len(params):
                # torch warns and updates it once per listing; the engine holds one master per parameter.
                raise ValueError(f"strata.torch: param group {gi} lists a parameter more than once (torch warns "
                                 "that this will be an error); list each parameter once")
            wd = float(g.get("weight_decay", base_wd))
            if wd not in (0.0, base_wd):
                raise ValueError(f"strata.torch: param group {gi} has weight_decay {wd}; the engine applies the "
                                 f"config's {base_wd} or 0 per parameter")
            if "eps" in g and float(g["eps"]) != base_eps:
                raise ValueError(f"strata.torch: param group {gi} has eps {g['eps']}; the engine's AdamW uses the "
                                 f"config's optimizer.params.eps ({base_eps}) for every group")
            for key in ("amsgrad", "maximize"):
                if g.get(key):
                    raise ValueError(f"strata.torch: param group {gi} sets {key}=True; the engine's AdamW does not "
                                     "implement it")
            for p in params:
                if id(p) not in named:
                    raise ValueError("strata.torch: a parameter in model_parameters is not one of the model's")
                self._lr_group[id(p)] = gi
                self._decay[id(p)] = wd != 0.0
            og = {k: v for k, v in g.items() if k != "params"}
            og.setdefault("lr", base_lr)
            lr = og["lr"]
            if not torch.is_tensor(lr) and (isinstance(lr, bool) or not isinstance(lr, (int, float))
                                            or not lr >= 0 or not math.isfinite(lr)):
                raise ValueError(f"strata.torch: param group {gi} has lr {lr!r}; expected a finite number >= 0 "
                                 "(torch.optim refuses it too)")
            og["params"] = params
            opt_groups.append(og)
        betas = opt_params.get("betas", [0.9, 0.999])
        if (not isinstance(betas, (list, tuple)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas)):
            raise ValueError(f"strata.torch.initialize: config optimizer.params.betas is {betas!r}: expected two "
                             "numbers [beta1, beta2]")
        defaults = {"lr": base_lr, "weight_decay": base_wd, "betas": (float(betas[0]), float(betas[1])),
                    "eps": base_eps, "amsgrad": False, "maximize": False}
        for gi, og in enumerate(opt_groups):
            _group_lr_betas(gi, og, defaults["betas"])
        self.optimizer = _Optimizer(opt_groups, defaults)
        self.optimizer._engine = weakref.ref(self)
        # What the engine fixes at initialize: a group's lr and betas may
        # change between steps (schedulers), these may not (step() refuses).
        self._fixed = [{k: g[k] for k in _FIXED_GROUP_KEYS} for g in self.optimizer.param_groups]
        # ... and which parameters each group holds (step() refuses a change).
        self._group_members = [tuple(id(p) for p in g["params"]) for g in self.optimizer.param_groups]
        # The schedule: the config's DeepSpeed "scheduler" section, or a torch
        # scheduler (or a callable building one on the optimizer). Built here,
        # before the engine: a bad section costs nothing, and it sets the
        # param groups' lr for the first step.
        if "scheduler" in cfg:
            lr_scheduler = lr_schedules.from_config(self.optimizer, cfg["scheduler"],
                                                    where="strata.torch.initialize: config scheduler")
        elif callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            lr_scheduler = lr_scheduler(self.optimizer)
        elif lr_scheduler is not None and getattr(lr_scheduler, "optimizer", self.optimizer) is not self.optimizer:
            # A scheduler on the caller's own optimizer (deepspeed.initialize(optimizer=opt,
            # lr_scheduler=sched) ported by dropping optimizer=) would set the lr of
            # an optimizer nothing steps, and the engine would train at the config's.
            raise ValueError("strata.torch.initialize: lr_scheduler= was built on another optimizer than the one "
                             "initialize() makes (its .optimizer is a "
                             f"{type(lr_scheduler.optimizer).__name__}); pass a function that builds it on "
                             "Strata's, e.g. lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10), "
                             "or the config's \"scheduler\" section")
        self.lr_scheduler = lr_scheduler

        # Ownership: the first module whose _parameters hold a parameter.
        self._params = []        # pid -> Parameter
        self._frozen_at_init = []  # pids with requires_grad False at initialize() (no master, no state)
        self._names = []         # pid -> qualified name
        self._pid = {}           # id(param) -> pid
        self._group_of = []      # pid -> group index
        group_names, group_params = [], []
        self._module_groups = {}  # module -> [group index]
        self._holders = {}        # pid -> [(module, name)]: the modules whose _parameters hold it
        for mname, mod in model.named_modules(remove_duplicate=False):
            used = []
            for pname, p in mod._parameters.items():
                if p is None:
                    continue
                if id(p) not in self._pid:
                    if type(p) is _EngineParameter and getattr(p._strata_engine(), "_e", None) is not None:
                        raise ValueError(f"strata.torch.initialize: parameter {named.get(id(p), pname)} is held by "
                                         "another strata.torch engine already (destroy() that one first)")
                    gname = mname or "<root>"
                    if not group_names or group_names[-1] != gname:
                        group_names.append(gname)
                        group_params.append([])
                    pid = len(self._params)
                    self._pid[id(p)] = pid
                    self._params.append(p)
                    self._names.append(named.get(id(p), f"{mname}.{pname}"))
                    self._group_of.append(len(group_names) - 1)
                    group_params[-1].append(pid)
                holders = self._holders.setdefault(self._pid[id(p)], [])
                if not any(h is mod and n == pname for h, n in holders):
                    holders.append((mod, pname))
                gi = self._group_of[self._pid[id(p)]]
                if gi not in used:
                    used.append(gi)
            if used:
                self._module_groups.setdefault(mod, [])
                for gi in used:
                    if gi not in self._module_groups[mod]:
                        self._module_groups[mod].append(gi)
        # Parameters a module's forward uses but another module owns:
        # register_external_parameter()'s, and nn.MultiheadAttention's out_proj
        # (its forward calls F.multi_head_attention_forward with
        # out_proj.weight/bias; out_proj's own forward never runs).
        for mname, mod in model.named_modules(remove_duplicate=True):
            external = list(getattr(mod, "_strata_external", ()))
            if isinstance(mod, torch.nn.MultiheadAttention):
                external += [q for q in mod.out_proj.parameters(recurse=False)]
            for q in external:
                if id(q) not in self._pid:
                    raise ValueError(f"strata.torch: a parameter registered as external to module "
                                     f"{mname or '<root>'} is not one of the model's")
                self._add_external(mod, self._group_of[self._pid[id(q)]])
        self._group_params = group_params
        self._group_names = group_names

        # The engine keeps fp32 masters and computes in the compute dtype:
        # other parameters would silently become float (an index tensor) or
        # lose precision (float64), so they are refused by name.
        for pid, p in enumerate(self._params):
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                what = ("only floating-point parameters live in the engine: register it as a buffer"
                        if not p.dtype.is_floating_point and not p.dtype.is_complex else
                        f"the engine keeps fp32 masters and computes in {self.compute_dtype}: convert the model "
                        "(model.float()) or keep this parameter out of it")
                raise ValueError(f"strata.torch.initialize: parameter {self._names[pid]} is {p.dtype}: {what}")
        lower = sorted({str(p.dtype).replace("torch.", "") for p in self._params if p.dtype != torch.float32})
        if lower and self.compute_dtype == torch.float32:
            # DeepSpeed would compute in the model's dtype here; the engine
            # computes in the config's (fp32 masters either way).
            warnings.warn(f"strata.torch.initialize: the model's parameters are {'/'.join(lower)} but the config "
                          "enables neither bf16 nor fp16: the engine computes in fp32 (2x the memory and time of "
                          "bf16); set \"bf16\": {\"enabled\": true} to compute in bf16", stacklevel=3)

        # The engine.
        descs = (_lib.ParamDesc * len(self._params))()
        keep = []  # the name bytes must outlive the create call
        for pid, p in enumerate(self._params):
            d = descs[pid]
            d.struct_size = ctypes.sizeof(_lib.ParamDesc)
            name = self._names[pid].encode()
            group = group_names[self._group_of[pid]].encode()
            keep += [name, group]
            d.name, d.group = name, group
            d.ndim = p.dim()
            for i, s in enumerate(p.shape):
                d.shape[i] = s
            d.dtype = _DTYPES[self.compute_dtype]
            d.frozen = 0 if p.requires_grad else 1
            if not p.requires_grad:
                self._frozen_at_init.append(pid)
            d.no_weight_decay = 0 if self._decay.get(id(p), True) else 1
            d.lr_group = self._lr_group.get(id(p), 0)
            if p.requires_grad and id(p) not in self._lr_group:
                raise ValueError(f"strata.torch: trainable parameter {self._names[pid]} is in no param group of "
                                 "model_parameters")
        opts = _lib.EngineOptions()
        _lib.check(_lib.strata_engine_options_init(ctypes.byref(opts)))
        cfg_bytes = json.dumps(engine_cfg).encode()
        opts.config_json = cfg_bytes
        if self._cuda:
            opts.device_kind = _lib.DEVICE_CUDA
            opts.device_ordinal = self.device.index or 0
        else:
            opts.device_kind = _lib.DEVICE_HOST
        opts.comm_kind, opts.mpi_comm = comm_kind, comm_handle
        if comm_kind != _lib.COMM_NONE:
            opts.comm_timeout_s = _comm_timeout_s()
        if given_ranks is not None:
            store_addr = given_ranks[2].encode()  # kept alive across the call
            opts.comm_rank, opts.comm_world_size, opts.comm_store_addr, opts.comm_store_port = (
                given_ranks[0], given_ranks[1], store_addr, given_ranks[3])
        with self._driving():  # Ctrl-C while the ranks meet ends the wait at once (_lib.create_engine)
            e = _lib.create_engine(opts, descs, len(self._params))
        self._e = e
        self._owner_pid = os.getpid()
        _LIVE_ENGINES.add(self)
        rank, world = ctypes.c_uint32(), ctypes.c_uint32()
        _lib.check(_lib.strata_engine_ranks(e, ctypes.byref(rank), ctypes.byref(world)), e)
        self.rank, self.world_size = rank.value, world.value
        # The batch sizes with the real world size (an mpi_comm handle's size
        # is known only now); every derived value is DeepSpeed's.
        try:
            sizes = _batch_sizes(self._cfg_batch, self.world_size)
        except ValueError:
            _lib.strata_engine_destroy(e)  # nothing of the model is the engine's yet
            self._e = None
            raise
        if sizes[2] != self.gradient_accumulation_steps:
            # The engine was made with the launcher's world size (an mpi_comm
            # handle's size is known only now): its plan counted another
            # accumulation. Python drives the micro-batches, so the numbers
            # are right either way; the plan's byte counts are not.
            warnings.warn(f"strata.torch: gradient_accumulation_steps is {sizes[2]} for {self.world_size} ranks, "
                          f"the engine planned {self.gradient_accumulation_steps}; give "
                          "gradient_accumulation_steps in the config to plan it exactly")
        (self.train_batch_size, self.train_micro_batch_size_per_gpu,
         self.gradient_accumulation_steps) = (None if v is None else _CallableInt(v) for v in sizes)
        if self._cuda:
            self._s = None
            self._switch(torch.cuda.current_stream(self.device))
        else:
            s = ctypes.c_void_p()
            _lib.check(_lib.strata_stream_create(e, b"strata.torch", ctypes.byref(s)), e)
            self._s = s

        # Initial values (the engine reads host memory), then the placeholders:
        # one zero scalar on the model's device (alive as long as the engine)
        # expanded to each parameter's shape. With several ranks every value
        # is rank 0's, as DDP and DeepSpeed start every rank from rank 0's
        # model: ranks whose models were initialised without a common seed (a
        # LoRA adapter's random A) train one model, not a mix of each rank's
        # shards. Only the parameters some rank holds differently are
        # broadcast (into a copy): the usual start, every rank loading the
        # same checkpoint, sends a checksum per parameter, not the model.
        self._scalar = torch.zeros((), dtype=self.compute_dtype, device=self.device)
        self._scalar_ptr = self._scalar.untyped_storage().data_ptr()
        with torch.no_grad():
            differ = self._differing_params() if self.world_size > 1 else set()
            for pid, p in enumerate(self._params):
                src = p.detach().to(device="cpu", dtype=torch.float32, copy=pid in differ).contiguous()
                if pid in differ:
                    self._call(_lib.strata_engine_broadcast, src.data_ptr(), src.numel() * 4, 0)
                self._call(_lib.strata_engine_load_param, pid, src.data_ptr(), _lib.DTYPE_F32, src.numel())
                p.data = self._placeholder(p)
                # Any use between uses is refused by name (_EngineParameter).
                p.__class__ = _EngineParameter
                p._strata_placeholder = self._scalar_ptr
                p._strata_name = self._names[pid]
                p._strata_engine = weakref.ref(self)
            if self.world_size > 1:
                # The buffers too (DDP's start does the same; its
                # broadcast_buffers then repeats it at every forward, for
                # models whose forward changes them: BatchNorm's statistics).
                for b in model.buffers():
                    if b.numel() > 0:
                        host = b.detach().to(device="cpu", copy=True).contiguous()
                        self._call(_lib.strata_engine_broadcast, host.data_ptr(),
                                   host.numel() * host.element_size(), 0)
                        b.copy_(host)
        self._held = collections.Counter()  # group -> holders
        self._views = {}                    # pid -> tensor viewing the engine buffer (while held)
        self._live = {}                     # storage data_ptr -> pid (while held)
        self._bwd = collections.OrderedDict()  # groups acquired in backward, oldest first
        self._in_backward = False  # inside backward(): forwards are checkpoint recomputations
        self._boundary = None      # set_gradient_accumulation_boundary's override
        self._betas_set = {}       # param group -> the betas last given to the engine
        self._copies = {}          # pid -> storage ptr of its private copy (recomputation)
        self._swapped = set()      # frozen pids whose copy stands in for them in their modules (recomputation)
        self._micro = 0        # micro-batches since the last step
        self._micro_steps = 0  # step() calls (DeepSpeed's micro_steps)
        self.last_step = None
        self._outside_grads = False  # a gradient arrived outside backward() (loss.backward())
        self._step_applied = False
        self._warned_empty_step = False
        self.global_steps = 0     # optimizer boundaries passed, skipped ones included (DeepSpeed's count)
        self.global_samples = 0
        self.skipped_steps = 0
        self._hooks = []
        self._hooked = set()
        self._fwd = []        # the open forward scopes (_open_forward)
        self._versions = {}   # pid -> the parameter's _version when acquired (in-place changes are refused)
        self._zero_pending = False  # zero_grad() after a backward: the next micro-batch drops the earlier ones
        self._changed_in_place = []
        self._begun = False   # a micro-batch began and no backward followed yet
        # model(x) works as engine(x) (DeepSpeed's ZeRO-3 hooks the module
        # too): the root's hooks open and close the forward, before and
        # after any other hook of the root.
        self._hooks.append(model.register_forward_pre_hook(self._root_pre_forward, prepend=True))
        for mod in self._module_groups:
            self._hook(mod)
        for pid, p in enumerate(self._params):
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(pid)))
        self._hooks.append(model.register_forward_hook(self._root_post_forward, always_call=True))

    def _differing_params(self):
        """The ids of the parameters whose initial fp32 values are not the same on every rank (_checksum):
        rank 0's checksums go to every rank, then each rank's verdicts to every rank (one broadcast of a
        byte per parameter from each rank), so every rank takes the same broadcasts after. A collective."""
        n = len(self._params)
        mine = torch.tensor([_checksum(p) for p in self._params], dtype=torch.int64).reshape(n, 2)
        ref = mine.clone()
        self._call(_lib.strata_engine_broadcast, ref.data_ptr(), ref.numel() * 8, 0)
        verdict = (mine != ref).any(dim=1).to(torch.uint8)
        seen = torch.zeros(n, dtype=torch.uint8)
        for r in range(self.world_size):
            buf = verdict.clone() if r == self.rank else torch.zeros(n, dtype=torch.uint8)
            self._call(_lib.strata_engine_broadcast, buf.data_ptr(), n, r)
            seen |= buf
        return {pid for pid in range(n) if seen[pid]}

    # ---------------------------------------------------------------- ownership

    def _hook(self, mod):
        if id(mod) not in self._hooked:
            self._hooked.add(id(mod))
            self._hooks.append(mod.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(mod.register_forward_hook(self._post_forward))

    def _add_external(self, mod, g):
        groups = self._module_groups.setdefault(mod, [])
        if g not in groups:
            groups.append(g)
        if hasattr(self, "_hooks"):  # after initialize(): register_external_parameter on a live engine
            self._hook(mod)

    def _outside_message(self, p, what):
        pid = self._pid[id(p)]
        owners = [n or "<root>" for n, m in self.module.named_modules(remove_duplicate=False)
                  if self._group_of[pid] in self._module_groups.get(m, ())]
        return (f"strata.torch: parameter {self._names[pid]} was used ({what}) outside the forward of the modules "
                f"that hold it ({', '.join(owners[:4])}): between uses it holds no value (its values live in the "
                "engine). Use it inside such a module's forward, or declare the module whose forward uses it: "
                "strata.torch.register_external_parameter(module, parameter) (DeepSpeed's "
                "deepspeed.zero.register_external_parameter); engine.state_dict() and engine.parameter_fp32(name) "
                "read the trained values")

    # ---------------------------------------------------------------- plumbing

    def _device_budget(self, section):
        """Settles the engine's device budget in the config's "strata" section
        (changed in place; returns strata.device_memory as the engine gets it).

        On CUDA the engine shares the GPU with PyTorch's caching allocator, so
        it never detects its budget itself (what is free less 5%, which would
        leave torch almost nothing): strata.device_memory as given, else
        strata.device_memory_fraction (default DEVICE_MEMORY_FRACTION) of the
        memory free now; strata.device_reserve defaults to 0 (torch's
        activations live outside the engine's budget), on the CPU as well."""
        fraction = section.pop("device_memory_fraction", None)
        if not self._cuda:
            if fraction is not None:
                raise ValueError("strata.torch: strata.device_memory_fraction is for a model on a GPU (this one is "
                                 "on the CPU: the host backend's budget is strata.device_memory)")
            # torch's activations are torch's on the CPU too: the engine's
            # RAM "device" holds only its buffers, nothing to reserve for them
            # (2 GiB taken from a loaded machine's MemAvailable refused tiny models).
            section.setdefault("device_reserve", 0)
            return section.get("device_memory")
        given = section.get("device_memory", 0)
        if given in (0, "0", None):
            fraction = DEVICE_MEMORY_FRACTION if fraction is None else fraction
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction < 1.0:
                raise ValueError(f"strata.torch: strata.device_memory_fraction is {fraction!r}: a number in (0, 1)")
            free, _ = torch.cuda.mem_get_info(self.device)
            section["device_memory"] = int(free * fraction)
        elif fraction is not None:
            raise ValueError("strata.torch: the config gives both strata.device_memory and "
                             "strata.device_memory_fraction: keep one")
        section.setdefault("device_reserve", 0)
        return section["device_memory"]

    def _call(self, fn, *args):
        if self._e is None:
            raise StrataError(1, f"strata.torch: {fn.__name__}: the engine was destroyed (engine.destroy())")
        with self._driving():
            _lib.check(fn(self._e, *args), self._e)

    def _driving(self):
        """Around every call into the engine: the lock (the C ABI's driving
        calls must never overlap, and backward hooks run on autograd's thread),
        and on CUDA the engine's device current for the call (the C library
        sets the calling thread's device; torch.cuda.device puts the caller's
        back)."""
        return self._on_device() if self._cuda else self._lock

    @contextlib.contextmanager
    def _on_device(self):
        with self._lock, torch.cuda.device(self.device):
            yield

    def _placeholder(self, p):
        return self._scalar.expand(p.shape)

    # ---------------------------------------------------------------- streams (CUDA: PyTorch's)

    def _wrap(self, stream):
        """The strata stream wrapping a torch.cuda.Stream of the engine's device (one per native stream)."""
        h = stream.cuda_stream
        entry = self._wrapped.get(h)
        if entry is None:
            s = ctypes.c_void_p()
            with self._driving():
                _lib.check(_lib.strata_stream_wrap(self._e, ctypes.c_void_p(h), ctypes.byref(s)), self._e)
            entry = self._wrapped[h] = (s, stream)  # the torch stream object kept alive with its wrapper
        return entry[0]

    def _switch(self, stream):
        self._s = self._wrap(stream)
        self._active = stream.cuda_stream

    def _use_stream(self):
        """The stream of work that reads the engine's buffers from here on (an
        acquire, a held view's use): the host backend's own stream; on CUDA,
        PyTorch's current stream, which must be the one the held groups were
        acquired on."""
        if not self._cuda:
            return self._s
        cur = torch.cuda.current_stream(self.device)
        if cur.cuda_stream != self._active:
            if self._held:
                held = [self._group_names[g] for g in self._held]
                raise StrataError(1, f"strata.torch: PyTorch's current stream on {self.device} is "
                                     f"{cur.cuda_stream:#x} here, but groups {held[:4]} are held on stream "
                                     f"{self._active:#x}, where they were acquired: a module's forward and the "
                                     "backward must each run on one stream (change streams only between "
                                     "micro-batches, with torch.cuda.stream around the forward and backward)")
            self._switch(cur)
        return self._s

    def _grad_stream(self):
        """The stream a gradient was computed on (the engine reads it once that stream gets there)."""
        if not self._cuda:
            return self._s
        cur = torch.cuda.current_stream(self.device)
        return self._s if cur.cuda_stream == self._active else self._wrap(cur)

    # ---------------------------------------------------------------- acquire / release

    @_driven
    def _acquire(self, g):
        s = self._use_stream()
        if self._held[g] == 0:
            pids = self._group_params[g]
            # `param.data = t` after initialize(): the engine holds the
            # weights, so t would be dropped here without a word. (One scope
            # without the parameters' __torch_function__ for the whole group:
            # this runs on every acquire.)
            with torch._C.DisableTorchFunctionSubclass():
                replaced = [pid for pid in pids if pid not in self._copies and pid not in self._swapped
                            and self._params[pid].data_ptr() != self._params[pid]._strata_placeholder]
            if replaced:
                for pid in replaced:
                    self._params[pid].data = self._placeholder(self._params[pid])
                raise StrataError(1, f"strata.torch: parameter {self._names[replaced[0]]}'s .data was replaced after "
                                     "initialize(); the engine holds the weights and would drop it: set weights "
                                     "before initialize()")
            ptrs = (ctypes.c_void_p * len(pids))()
            n = ctypes.c_size_t()
            self._call(_lib.strata_engine_acquire, g, s, ptrs, len(pids), ctypes.byref(n))
            if not self._cuda:
                # Host backend: the CPU reads it now. On CUDA the stream
                # waits for the upload (an event), the host does not.
                _lib.check(_lib.strata_stream_synchronize(s), self._e)
            for pid in pids:
                p = self._params[pid]
                # The engine's buffer through DLPack: no copy; valid while held.
                view = torch.utils.dlpack.from_dlpack(_lib.param_capsule(self._e, pid))
                self._views[pid] = view
                self._live[view.untyped_storage().data_ptr()] = pid
                p.data = view
            with torch._C.DisableTorchFunctionSubclass():
                for pid in pids:
                    self._versions[pid] = self._params[pid]._version
        self._held[g] += 1

    @_driven
    def _release(self, g, reset=True, stream=None):
        """Drops one hold; at the last, on `stream` (None: the current one,
        checked as for a use: the release orders the buffer's reuse after the
        work enqueued on it)."""
        s = self._use_stream() if stream is None else stream
        self._held[g] -= 1
        if self._held[g] > 0:
            return
        del self._held[g]
        # An in-place change of a weight while held (nn.Embedding's max_norm
        # renormalizing rows, a clamp_ in forward) reached the compute copy
        # only, never the engine's fp32 weights: named at the forward's end
        # (_post_forward), not kept silently.
        with torch._C.DisableTorchFunctionSubclass():
            for pid in self._group_params[g]:
                was = self._versions.pop(pid, None)
                if was is not None and was != self._params[pid]._version:
                    self._changed_in_place.append(self._names[pid])
        for pid in self._group_params[g]:
            view = self._views.pop(pid, None)
            if view is not None:
                self._live.pop(view.untyped_storage().data_ptr(), None)
            p = self._params[pid]
            if reset:
                p.data = self._placeholder(p)
        self._call(_lib.strata_engine_release, g, s)

    @_driven
    def _release_backward(self):
        # After backward() returned, on the caller's thread: every use of these
        # groups was enqueued on the stream they were acquired on (checked), so
        # they are released there, whatever the caller's current stream.
        while self._bwd:
            g, _ = self._bwd.popitem(last=False)
            self._release(g, stream=self._s)

    # ---------------------------------------------------------------- hooks

    @_driven
    def _pre_forward(self, module, args):
        if self._in_backward:
            # Activation checkpointing recomputes this forward inside backward
            # and keeps what it saves (raw tensors, not our tokens) until the
            # segment's backward is done, or stops the recomputation midway
            # (so the post-forward hook may never run): the module computes
            # with private copies of its weights, and the group is released
            # at once.
            #
            # A frozen parameter's copy is not set as its .data but put in
            # its place in the modules that hold it (a Parameter of its own,
            # restored by _drop_copies): non-reentrant checkpointing saves a
            # tensor that needs no gradient by reference, not detached, so
            # the saved tensor would be the engine's Parameter, whose .data
            # goes back to the placeholder after this module (zeros in
            # backward). A trainable parameter keeps its object (its gradient
            # must reach it), and torch saves it detached: a view of the copy.
            for g in self._module_groups[module]:
                self._acquire(g)
                frozen = []
                try:
                    for pid in self._group_params[g]:
                        copy = self._views[pid].clone()
                        p = self._params[pid]
                        if p.requires_grad:
                            p.data = copy
                        else:
                            stand_in = torch.nn.Parameter(copy, requires_grad=False)
                            for mod, name in self._holders.get(pid, ()):
                                mod._parameters[name] = stand_in
                            self._swapped.add(pid)
                            frozen.append(pid)
                        self._copies[pid] = copy.untyped_storage().data_ptr()
                finally:
                    self._release(g, reset=False)
                    # The engine's own frozen Parameter must not keep viewing
                    # the released buffer (a read outside a forward would see
                    # reused memory instead of being refused).
                    for pid in frozen:
                        if pid not in self._views:
                            self._params[pid].data = self._placeholder(self._params[pid])
            return
        if not self._fwd:
            # A submodule called by itself (model.get_input_embeddings()(ids)
            # for inputs_embeds): a forward scope of its own, as the root's.
            self._scope_enter(module)
        for g in self._module_groups[module]:
            self._acquire(g)

    @_driven
    def _post_forward(self, module, args, output):
        if self._in_backward:
            for g in self._module_groups[module]:
                self._drop_copies(self._group_params[g])
            return
        for g in self._module_groups[module]:
            self._release(g)
        if self._fwd and self._fwd[-1][2] is module:
            self._scope_exit(module)
        if self._changed_in_place:
            names, self._changed_in_place = self._changed_in_place, []
            raise StrataError(1, f"strata.torch: {names[0]}{f' (and {len(names) - 1} more)' if len(names) > 1 else ''} "
                                 f"was changed in place during {type(module).__name__}'s forward (e.g. "
                                 "nn.Embedding(max_norm=...) renormalizing rows, or a weight clamped in forward): "
                                 "the change would reach the compute copy only, never the engine's weights; "
                                 "refused (change weights with the optimizer, or before initialize())")

    def _drop_copies(self, pids):
        for pid in pids:
            if pid in self._copies:
                del self._copies[pid]
                p = self._params[pid]
                if pid in self._swapped:  # the modules hold the parameter again (the stand-in lives on where saved)
                    self._swapped.discard(pid)
                    for mod, name in self._holders.get(pid, ()):
                        mod._parameters[name] = p
                if pid not in self._views:
                    p.data = self._placeholder(p)

    def _pack(self, t):
        # Only a tensor of the engine's device type can view an engine buffer
        # (the CPU's on the host backend, CUDA's on the CUDA backend).
        if t.device.type != self._dev_type or t.layout != torch.strided:
            return t
        ptr = t.untyped_storage().data_ptr()
        if self._copies and ptr in self._copies.values():
            # A recomputation (reentrant checkpointing) saving a parameter that
            # holds a private copy: keep the copy itself, not the parameter,
            # whose .data changes back to the placeholder after the module.
            return t.detach()
        pid = self._live.get(ptr)
        if pid is None and ptr == self._scalar_ptr:
            which = [n for n, p in zip(self._names, self._params) if tuple(p.shape) in (tuple(t.shape),
                                                                                        tuple(reversed(t.shape)))]
            raise StrataError(1, "strata.torch: a parameter was used outside the forward of a module that owns it "
                                 f"(shape {tuple(t.shape)}: {', '.join(which[:4]) or 'unknown'}); between uses it "
                                 "holds no value: use it inside its module's forward, or register it on the module "
                                 "that uses it")
        return t if pid is None else _Saved(pid, t)

    @_driven
    def _unpack(self, obj):
        if not isinstance(obj, _Saved):
            return obj
        g = self._group_of[obj.pid]
        if g in self._bwd:
            self._use_stream()  # CUDA: the node computes on the stream the group was acquired on
            self._bwd.move_to_end(g)
        else:
            # A backward node unpacks what it needs, computes and is done: at
            # most two groups (one node's) stay held.
            while len(self._bwd) >= 2:
                old, _ = self._bwd.popitem(last=False)
                self._release(old)
            self._acquire(g)
            self._bwd[g] = True
        return torch.as_strided(self._views[obj.pid], obj.size, obj.stride, obj.offset)

    def _grad_hook(self, pid):
        def hook(p):
            g = p.grad
            p.grad = None
            if g is None:
                return
            if not self._in_backward:
                # loss.backward() in place of engine.backward(loss): neither
                # divided by the accumulation nor loss-scaled; step() refuses.
                self._outside_grads = True
            if g.dtype not in _DTYPES or g.is_sparse:
                raise StrataError(1, f"strata.torch: gradient of {self._names[pid]} is {g.dtype}"
                                     f"{' (sparse)' if g.is_sparse else ''}: fp32/bf16/fp16 dense only")
            # Through DLPack the engine owns the gradient until its stream
            # has read it, then frees it (no wait here). On CUDA this runs on
            # autograd's thread, with the stream that computed the gradient
            # current.
            with self._driving():
                _lib.reduce_grad_capsule(self._e, pid, torch.utils.dlpack.to_dlpack(g.contiguous()),
                                         self._grad_stream())
        return hook

    # ---------------------------------------------------------------- DeepSpeed's engine API

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        if self._auto_cast:
            args = _cast_half(args)
        self._prune_scopes(None)
        self._open_forward("engine", None)
        try:
            out = self.module(*args, **kwargs)
        except BaseException:
            self._close_forward(failed=True)
            raise
        self._close_forward(failed=False)
        return out

    # A forward scope: engine(x), or a module of the model called by itself
    # (model(x) as under DeepSpeed's ZeRO-3, whose hooks are the module's; a
    # submodule). Entries of self._fwd: (the saved-tensor hooks entered,
    # "engine" or "model", the module, the exception being handled when it
    # opened).

    def _open_forward(self, by, module):
        """With gradients enabled, the first forward since the last backward begins the micro-batch (more
        forwards before one backward belong to it); what autograd saves goes through the pack hooks. Under
        torch.no_grad() (evaluation) nothing begins: the engine averages over the micro-batches it was told
        of."""
        if torch.is_grad_enabled() and not self._begun:
            if self._zero_pending:
                # optimizer.zero_grad() since the last backward: those
                # micro-batches' gradients go, as DeepSpeed's ZeRO optimizer
                # overwrites them with the next backward's; the window counts on.
                self._zero_pending = False
                self._call(_lib.strata_engine_discard_step, self._s)
            last = (self._boundary if self._boundary is not None
                    else (self._micro + 1) % self.gradient_accumulation_steps == 0)
            self._call(_lib.strata_engine_begin_micro_batch, 1 if last else 0)
            self._begun = True
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()
        self._fwd.append((hooks, by, module, sys.exc_info()[1]))

    def _close_forward(self, failed):
        self._fwd.pop()[0].__exit__(None, None, None)
        if failed:
            self._abandon()

    def _prune_scopes(self, current):
        """Closes, as failed, the model scopes whose module is no longer running (a KeyboardInterrupt, or an
        exception after which torch ran no hook): the call stack says, not a count (a module may call
        itself). `current`: the module whose call is starting (its own frame does not count)."""
        while self._fwd and self._fwd[-1][1] == "model":
            module = self._fwd[-1][2]
            if _running_calls(module) - (module is current) > 0:
                return
            self._close_forward(failed=True)

    def _scope_enter(self, module):
        if self._in_backward:
            return  # a checkpointed recomputation
        self._prune_scopes(module)
        if not self._fwd:
            self._open_forward("model", module)

    def _scope_exit(self, module):
        if self._in_backward or not self._fwd:
            return
        hooks, by, opener, exc_at_open = self._fwd[-1]
        if by == "model" and opener is module and _running_calls(module) == 1:  # its outermost call
            # A root forward that raised comes here from torch's exception
            # handler (always_call): an exception other than the one being
            # handled when the scope opened.
            exc = sys.exc_info()[1]
            self._close_forward(failed=exc is not None and exc is not exc_at_open)

    def _root_pre_forward(self, module, args):
        self._scope_enter(module)

    def _root_post_forward(self, module, args, output):
        self._scope_exit(module)  # registered with always_call: also when the forward raised

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """loss.backward() of loss / gradient_accumulation_steps (DeepSpeed's scale_wrt_gas), with the fp16
        loss scale applied; the gradients go to the engine. retain_graph: as torch's."""
        if not torch.is_tensor(loss) or not loss.requires_grad:
            raise TypeError("strata.torch: backward(loss) takes the loss tensor of a forward run with gradients "
                            "enabled")
        if not self._begun:
            # The engine takes one backward per forward (a micro-batch): a
            # second one through a retained graph would reduce every
            # gradient twice.
            raise StrataError(1, "strata.torch: engine.backward() with no forward of the model since the last "
                                 "backward or step (a second backward through a retained graph?): the engine takes "
                                 "one backward per micro-batch; add the losses and call engine.backward(total) once")
        scale = ctypes.c_double(1.0)
        self._call(_lib.strata_engine_loss_scale, ctypes.byref(scale))
        if scale_wrt_gas and self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        self._in_backward = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                (loss * scale.value if scale.value != 1.0 else loss).backward(retain_graph=retain_graph)
        except BaseException:
            self._abandon()
            raise
        finally:
            self._in_backward = False
            self._release_backward()
            self._drop_copies(list(self._copies))
        self._begun = False  # the next forward begins the next micro-batch
        self._micro += 1
        return loss  # DeepSpeed's: divided by the accumulation (scale_wrt_gas), without the fp16 scale

    @_driven
    def _abandon(self):
        """An exception in forward or backward: forget the step (groups, gradients)."""
        self._outside_grads = False
        self._zero_pending = False
        self._changed_in_place = []
        self._bwd.clear()
        for g in list(self._held):
            self._held[g] = 1
            self._release_quiet(g)
        _lib.strata_engine_discard_step(self._e, self._s)
        self._begun = False
        self._micro = 0
        self._micro_steps -= self._micro_steps % self.gradient_accumulation_steps  # the window starts again

    def _release_quiet(self, g):
        try:
            self._release(g, stream=self._s)  # where the held groups were acquired
        except StrataError:
            pass

    def is_gradient_accumulation_boundary(self):
        """DeepSpeed's: whether the micro-batch in progress (the next one, once step() returned) ends an
        accumulation window: (micro_steps + 1) % gradient_accumulation_steps == 0, micro_steps counting the
        step() calls as DeepSpeed's engine does, or as set_gradient_accumulation_boundary() says."""
        if self._boundary is not None:
            return self._boundary
        return (self._micro_steps + 1) % self.gradient_accumulation_steps == 0

    def _at_boundary(self):
        """Whether step() acts now: a window of micro-batches is complete (backward() counts them)."""
        if self._micro == 0:
            return False
        if self._boundary is not None:
            return self._boundary
        return self._micro % self.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary):
        """DeepSpeed's override: set before each forward/backward; True on the
        micro-batch that ends the window (e.g. a short last window of an
        epoch), None for the automatic count again. As in DeepSpeed the
        gradients are still divided by gradient_accumulation_steps, not by the
        window's length."""
        self._boundary = None if is_boundary is None else bool(is_boundary)

    def step(self, lr_kwargs=None):
        """At the accumulation boundary: one optimizer step with the param_groups' learning rates; then the
        lr scheduler's step(**lr_kwargs), as DeepSpeed's (ReduceLROnPlateau: lr_kwargs={"metrics": loss})."""
        if self._outside_grads:
            # Gradients that did not come through backward(): loss.backward()
            # bypasses the engine's accounting (the accumulation's division,
            # the loss scale).
            self._abandon()
            raise StrataError(1, "strata.torch: step() after gradients that did not come through "
                                 "engine.backward(loss) (loss.backward() is not enough: the engine divides the loss "
                                 "by the accumulation, scales it and counts the micro-batch there); the step's "
                                 "micro-batches were discarded")
        if self._micro == 0 and self._begun:
            # A forward with autograd on and no backward (an evaluation
            # without torch.no_grad()): its micro-batch reduced nothing and
            # is dropped (with strata.overlap_backward the engine would
            # otherwise wait for it).
            self._abandon()
        self._step_applied = False
        ds_boundary = self.is_gradient_accumulation_boundary()
        self._micro_steps += 1  # DeepSpeed's micro_steps: every step() call
        if self._micro == 0 and ds_boundary and not self._warned_empty_step:
            self._warned_empty_step = True
            warnings.warn("strata.torch: step() at an accumulation boundary with no engine.backward() since the "
                          "last step: nothing to update, the counters and the scheduler do not move (DeepSpeed "
                          "would run its optimizer and scheduler anyway); said once", stacklevel=2)
        if not self._at_boundary():
            return None
        # The update runs inside optimizer.step(), so the optimizer's step
        # hooks (register_step_pre_hook / register_step_post_hook, and torch's
        # global ones) run around it as around torch's: a pre-hook that sets a
        # group's lr sets this step's; a scheduler built on the optimizer sees
        # it stepped. (A step skipped for an fp16 overflow runs them too: the
        # engine knows of the overflow only inside the step.)
        self.optimizer._engine_step = self._apply_step
        try:
            r = self.optimizer.step()
        finally:
            self.optimizer._engine_step = None
        self.last_step = {"step": r.step, "skipped": bool(r.skipped), "grad_norm": r.grad_norm,
                          "clip_coef": r.clip_coef, "loss_scale": r.loss_scale, "lr": r.lr}
        # DeepSpeed's counters: every boundary counts, a skipped one also in skipped_steps.
        # Set before the scheduler steps: a scheduler that raises leaves them right.
        self.global_steps += 1
        self.global_samples += self.train_batch_size or 0
        self.skipped_steps += int(bool(r.skipped))
        self._step_applied = not r.skipped
        # As DeepSpeed: the schedule advances with the optimizer steps taken,
        # not with a step skipped for non-finite gradients (fp16 overflow).
        if self.lr_scheduler is not None and not r.skipped:
            try:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            except TypeError as e:
                if isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and not lr_kwargs:
                    raise TypeError("strata.torch: engine.step(): ReduceLROnPlateau needs the metric it "
                                    "watches: engine.step(lr_kwargs={\"metrics\": loss}) (the update itself "
                                    "was applied)") from e
                raise
        return self.last_step

    def _apply_step(self):
        """The update, run inside the optimizer's step() (after its pre-hooks): the param groups' lr and betas,
        checked for every group before the first is given to the engine, then the engine's step. A refusal
        changes nothing: the same step() again (the groups fixed) is this boundary's step."""
        groups = self.optimizer.param_groups
        try:
            self._check_parameter_set()
            for gi, group in enumerate(groups):
                for key, was in self._fixed[gi].items():
                    if group.get(key) != was:
                        raise ValueError(f"strata.torch: param group {gi}'s {key} changed from {was!r} to "
                                         f"{group.get(key)!r}; the engine takes {key} once, at initialize() (only "
                                         "lr and betas may change between steps)")
            hyper = [_group_lr_betas(gi, group, self.optimizer.defaults["betas"]) for gi, group in enumerate(groups)]
        except ValueError:
            self._micro_steps -= 1  # step() counted this call: its retry counts it again
            raise
        for gi, (lr, betas) in enumerate(hyper):
            self._call(_lib.strata_engine_set_group_lr, gi, lr)
            # A group's own betas (given in model_parameters, or cycled by
            # OneCycle's cycle_momentum); the config's otherwise.
            if betas != self._betas_set.get(gi, self.optimizer.defaults["betas"]):
                self._call(_lib.strata_engine_set_group_betas, gi, betas[0], betas[1])
                self._betas_set[gi] = betas
        r = _lib.StepResult()
        r.struct_size = ctypes.sizeof(r)
        self._call(_lib.strata_engine_step, -1.0, ctypes.byref(r))
        self._micro = 0
        self._zero_pending = False
        return r

    def _check_parameter_set(self):
        """What the engine fixed at initialize(): the param groups and their parameters, and the parameters
        frozen then (no master weights or optimizer states exist for them). A change is refused by name: torch
        would update what was added or unfrozen and leave alone what was removed; the engine would not."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self._group_members):
            raise ValueError(f"strata.torch: the optimizer has {len(groups)} param groups, {len(self._group_members)} "
                             "at initialize() (optimizer.add_param_group() or a removed group): the engine fixes "
                             "its parameters and groups at initialize(); make a new engine for another set")
        for gi, group in enumerate(groups):
            now = tuple(id(p) for p in group["params"])
            if now == self._group_members[gi]:
                continue
            was = set(self._group_members[gi])
            added = [self._names[self._pid[i]] if i in self._pid else "a tensor not in the model"
                     for i in now if i not in was]
            removed = [self._names[self._pid[i]] for i in was if i not in set(now) and i in self._pid]
            what = (f"{added[0]} was added to" if added else f"{removed[0]} was removed from" if removed
                    else "the order of the parameters changed in")
            raise ValueError(f"strata.torch: {what} param group {gi} after initialize(): the engine fixes its "
                             "parameters and groups at initialize() (to stop updating a parameter, set its "
                             "requires_grad to False)")
        for pid in self._frozen_at_init:
            if self._params[pid].requires_grad:
                raise ValueError(f"strata.torch: parameter {self._names[pid]} was frozen (requires_grad False) at "
                                 "initialize() and requires a gradient now: the engine holds no master weights or "
                                 "optimizer state for it; unfreeze it before initialize() to train it")

    def synchronize(self):
        """Waits until the last step's updates are applied (strata.pipelined_step: step() returns once the
        step is decided and the updates run behind the next forward) and raises their error, if any."""
        self._call(_lib.strata_engine_synchronize)

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    # DeepSpeed's engine API around the step.
    def was_step_applied(self):
        """Whether the last step() updated the parameters (False between boundaries and for a skipped step)."""
        return self._step_applied

    def get_global_grad_norm(self):
        """The gradient norm of the last optimizer step (before clipping), None before the first."""
        return None if self.last_step is None else float(self.last_step["grad_norm"])

    def zero_grad(self, set_to_none=True):
        """DeepSpeed's engine.zero_grad(): nothing to do (under ZeRO it clears param.grad, which holds
        nothing: the engine owns the gradients and starts each step from zero). To drop micro-batches
        backward took, as torch's optimizer.zero_grad() does, call the returned optimizer's zero_grad()."""
        return None

    def train(self, mode=True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    @property
    def training(self):
        """The model's training flag (DeepSpeed's engine is a Module and has one)."""
        return self.module.training

    @property
    def global_rank(self):
        return self.rank

    @property
    def local_rank(self):
        """This process's rank on its node: LOCAL_RANK as launchers set it, else the rank's device index on a
        GPU, else 0."""
        if "LOCAL_RANK" in os.environ:
            return int(os.environ["LOCAL_RANK"])
        return (self.device.index or 0) if self._cuda else 0

    def __deepcopy__(self, memo):
        # copy.deepcopy(engine.module) reaches the engine through the model's
        # hooks (was "cannot pickle '_thread.RLock'").
        raise TypeError("strata.torch: the engine (and a model it drives, whose hooks call it) cannot be copied: "
                        "copy the model before strata.torch.initialize, or build a new one from engine.state_dict()")

    def parameters(self, recurse=True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    # ---------------------------------------------------------------- weights and checkpoints

    def parameter_fp32(self, name):
        """The fp32 master of one parameter (its model name), on the CPU."""
        for pid, n in enumerate(self._names):
            if n == name:
                return self._read(pid)
        raise KeyError(name)

    def _read(self, pid):
        p = self._params[pid]
        out = torch.empty(p.shape, dtype=torch.float32)
        self._call(_lib.strata_engine_read_param, pid, out.data_ptr(), _lib.DTYPE_F32, out.numel())
        return out

    def optimizer_state(self, name):
        """torch.optim.AdamW's state of one parameter: {'step', 'exp_avg', 'exp_avg_sq'} (fp32, CPU;
        'step' is the parameter's own count, as torch keeps it)."""
        pid = self._names.index(name)
        p = self._params[pid]
        steps = ctypes.c_int64()
        self._call(_lib.strata_engine_param_steps, pid, ctypes.byref(steps))
        out = {"step": torch.tensor(float(steps.value))}
        for k, key in enumerate(("exp_avg", "exp_avg_sq")):
            t = torch.empty(p.shape, dtype=torch.float32)
            self._call(_lib.strata_engine_read_state, pid, k, t.data_ptr(), t.numel())
            out[key] = t
        return out

    def state_dict(self, rank=None):
        """The full trained weights (fp32 masters, CPU) under the model's own state_dict keys (buffers: a CPU copy).
        N ranks: a collective (every rank calls it); every rank gets the whole weights, or with rank=r only
        rank r does and the others an empty dict (they hold one parameter at a time: a writer's memory)."""
        return self._state_dict(rank is None or rank == self.rank)

    def _state_dict(self, keep):
        out = collections.OrderedDict()
        by_id = {}
        for key, t in self.module.state_dict(keep_vars=True).items():
            pid = self._pid.get(id(t))
            if pid is None:
                if keep:
                    out[key] = t.detach().clone() if t.device.type == "cpu" else t.detach().cpu()
                continue
            if pid not in by_id:
                whole = self._read(pid)  # a gather with N ranks: every rank takes part
                by_id[pid] = whole if keep else None
            if keep:
                out[key] = by_id[pid]
        return out

    def save_pretrained(self, directory, **kwargs):
        """A Hugging Face model directory with the trained weights (the model's own save_pretrained).
        N ranks: every rank calls it (the weights are gathered); rank 0 writes."""
        if not hasattr(self.module, "save_pretrained"):
            raise TypeError("strata.torch: the model has no save_pretrained; use engine.state_dict()")
        state = self.state_dict(rank=0)
        if self.rank == 0:
            self.module.save_pretrained(directory, state_dict=state, **kwargs)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's save_checkpoint: Strata's checkpoint of the whole training state (weights, AdamW state,
        step, loss scale), the param groups' learning rates and betas, the scheduler's state and
        client_state (JSON-serialisable) go to save_dir/tag (tag: default "global_step<global_steps>"), and
        save_dir/latest names the tag (save_latest). Every rank calls it. Returns True."""
        if self._micro != 0:
            raise StrataError(1, "strata.torch: save_checkpoint in the middle of an accumulation (after "
                                 f"{self._micro} micro-batches): save after engine.step()")
        if self._begun and not self._fwd:
            # A forward with autograd on and no backward after it (an
            # evaluation without torch.no_grad()): it began a micro-batch
            # that reduced nothing; dropped, as DeepSpeed saves here.
            self._abandon()
        if exclude_frozen_parameters:
            raise NotImplementedError("strata.torch: save_checkpoint(exclude_frozen_parameters=True) is not "
                                      "implemented (the checkpoint holds every parameter)")
        if tag is None:
            tag = f"global_step{self.global_steps}"
        if isinstance(tag, dict):
            raise TypeError("strata.torch: save_checkpoint's second argument is the tag; client_state is the "
                            "third argument, as in DeepSpeed")
        tag = str(tag)  # as DeepSpeed (its examples use loss.item() as a tag)
        if not tag or os.sep in tag or tag in (".", ".."):
            raise ValueError(f"strata.torch: save_checkpoint tag {tag!r} is not a directory name")
        groups = self.optimizer.param_groups
        extra = {"strata_torch": {"buffers": self._buffers_state(),
                                  "lrs": [float(g["lr"]) for g in groups],
                                  "betas": [[float(b) for b in g["betas"]] for g in groups],
                                  "counters": [self.global_steps, self.global_samples, self.skipped_steps],
                                  "client_state": client_state,
                                  "lr_scheduler": (_encode_state(self.lr_scheduler.state_dict(), "the lr "
                                                                 "scheduler's state_dict()")
                                                   if self.lr_scheduler else None)}}
        # Stored as JSON (DeepSpeed pickles): checked before anything is
        # written (the scheduler's state already is, by _encode_state).
        try:
            text = json.JSONEncoder(allow_nan=False).encode(client_state)
        except (TypeError, ValueError) as e:
            raise TypeError("strata.torch: save_checkpoint: client_state must be JSON-serialisable (Strata stores it "
                            f"as JSON, not pickle): {e}") from None
        if json.loads(text) != client_state:
            warnings.warn("strata.torch: save_checkpoint: client_state is stored as JSON and will load as "
                          f"{text[:200]} (keys become strings, tuples lists)", stacklevel=2)
        payload = json.dumps(extra).encode()
        os.makedirs(save_dir, exist_ok=True)
        self._call(_lib.strata_engine_save_checkpoint, os.fsencode(os.path.join(save_dir, tag)), payload)
        if save_latest:
            # Rank 0 writes `latest`; its outcome (0, or the errno) goes to
            # every rank, so all raise or none does (a collective, as the
            # save is).
            latest = os.path.join(save_dir, "latest")
            failure = None
            if self.rank == 0:
                tmp = os.path.join(save_dir, f".latest.{os.getpid()}")
                try:
                    with open(tmp, "w") as f:
                        f.write(tag)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, latest)
                except OSError as e:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                    failure = (e.errno or errno.EIO, e.strerror or str(e))
            if self.world_size > 1:
                code = torch.tensor([failure[0] if failure else 0], dtype=torch.int64)
                self._call(_lib.strata_engine_broadcast, code.data_ptr(), 8, 0)
                if failure is None and int(code[0]) != 0:
                    failure = (int(code[0]), f"{os.strerror(int(code[0]))} on rank 0")
            if failure is not None:
                status = {errno.ENOSPC: 3, errno.EDQUOT: 3, errno.EACCES: 7, errno.EPERM: 7,
                          errno.EROFS: 7}.get(failure[0], 2)  # NO_SPACE, PERMISSION, else IO
                raise StrataError(status, f"strata.torch: save_checkpoint: checkpoint {os.path.join(save_dir, tag)} "
                                          f"is saved, but writing {latest} failed ({failure[1]}): it still names the "
                                          "previous tag; load this one with load_checkpoint(save_dir, "
                                          f"tag={tag!r})") from None
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's load_checkpoint: restores save_dir/tag (tag None: the one save_dir/latest names; a
        directory that is itself a checkpoint, as earlier versions wrote it, also loads) and returns
        (its path, client_state); (None, None) with a warning when there is no checkpoint to load, as
        DeepSpeed does. The whole state always comes back: partial loads are refused by name."""
        for name, value, default in (("load_module_strict", load_module_strict, True),
                                     ("load_optimizer_states", load_optimizer_states, True),
                                     ("load_lr_scheduler_states", load_lr_scheduler_states, True),
                                     ("load_module_only", load_module_only, False),
                                     ("custom_load_fn", custom_load_fn, None)):
            if value != default:
                raise NotImplementedError(f"strata.torch: load_checkpoint({name}={value!r}) is not implemented "
                                          "(a Strata checkpoint restores the whole training state)")
        if tag is not None:
            path = os.path.join(load_dir, str(tag))
        elif os.path.isfile(os.path.join(load_dir, "latest")):
            with open(os.path.join(load_dir, "latest")) as f:
                latest = f.read().strip()
            if not latest or os.sep in latest or latest in (".", ".."):
                raise StrataError(1, f"strata.torch: load_checkpoint: {os.path.join(load_dir, 'latest')} names "
                                     f"{latest!r}, not a tag (a directory in {load_dir}); pass tag=")
            path = os.path.join(load_dir, latest)
        elif os.path.isfile(os.path.join(load_dir, "index.json")):
            path = load_dir  # itself a checkpoint (the package's earlier layout)
        else:
            warnings.warn(f"strata.torch: load_checkpoint: {os.path.join(load_dir, 'latest')} does not exist and "
                          f"{load_dir} is no checkpoint: nothing loaded (pass tag= to load a given one)")
            return None, None
        p = ctypes.c_void_p()
        self._call(_lib.strata_engine_load_checkpoint, os.fsencode(path), ctypes.byref(p))
        text = ctypes.string_at(p).decode() if p.value else "{}"
        if p.value:
            _lib.strata_free(p)
        extra = json.loads(text or "{}").get("strata_torch", {})
        self._load_buffers(extra.get("buffers"), path)
        groups = self.optimizer.param_groups
        for g, lr in zip(groups, extra.get("lrs", [])):
            g["lr"] = lr
        # The betas a scheduler set (OneCycle's cycle_momentum): the next
        # step gives every group's to the engine again.
        for g, betas in zip(groups, extra.get("betas", [])):
            g["betas"] = tuple(betas)
        self._betas_set = {gi: None for gi in range(len(groups))}
        if "counters" in extra:
            self.global_steps, self.global_samples, self.skipped_steps = extra["counters"]
        else:  # a checkpoint saved before the counters were: the engine's own count
            s = self.stats()
            self.global_steps = s["steps"] + s["skipped_steps"]
            self.global_samples = self.global_steps * (self.train_batch_size or 0)
            self.skipped_steps = s["skipped_steps"]
        if self.lr_scheduler is not None and extra.get("lr_scheduler"):
            state = _decode_state(extra["lr_scheduler"])
            milestones = state.get("milestones")
            if isinstance(milestones, dict) and not isinstance(milestones, collections.Counter):
                # Saved before the state was encoded (plain JSON made
                # MultiStepLR's int milestones strings: it never decayed).
                state["milestones"] = collections.Counter({int(k): v for k, v in milestones.items()})
            self.lr_scheduler.load_state_dict(state)
        self._micro = 0
        self._micro_steps = self.global_steps * self.gradient_accumulation_steps  # a window starts here
        client_state = extra.get("client_state")
        return path, ({} if client_state is None else client_state)  # DeepSpeed's: {} when none was saved

    def _persistent_buffers(self):
        """The module's buffers its state_dict holds (BatchNorm's running statistics, ...), by name; not the
        non-persistent ones (a causal mask, RoPE's inv_freq), which DeepSpeed's checkpoint leaves out too."""
        out = {}
        for name, b in self.module.named_buffers():
            owner, _, leaf = name.rpartition(".")
            mod = self.module.get_submodule(owner) if owner else self.module
            if b is not None and leaf not in getattr(mod, "_non_persistent_buffers_set", ()):
                out[name] = b
        return out

    def _buffers_state(self):
        # In the checkpoint's JSON (atomic with it): dtype, shape and the raw
        # bytes in base64. Parameters live in the engine; buffers in the module.
        state = {}
        for name, b in self._persistent_buffers().items():
            t = b.detach().to("cpu").contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            state[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                           "data": base64.b64encode(raw).decode()}
        return state

    def _load_buffers(self, state, path):
        if state is None:
            if self._persistent_buffers():
                warnings.warn(f"strata.torch: load_checkpoint: {path} was saved before checkpoints held the "
                              "module's buffers (BatchNorm's running statistics, ...): they keep their current "
                              "values", stacklevel=3)
            return
        have = self._persistent_buffers()
        missing, unexpected = sorted(set(have) - set(state)), sorted(set(state) - set(have))
        if missing or unexpected:
            raise StrataError(1, f"strata.torch: load_checkpoint: {path}'s module buffers do not match the "
                                 f"model's (missing: {missing}, unexpected: {unexpected})")
        for name, b in have.items():  # every one checked before any is written
            s = state[name]
            if getattr(torch, s["dtype"], None) != b.dtype or list(b.shape) != s["shape"]:
                raise StrataError(1, f"strata.torch: load_checkpoint: buffer {name} is {s['dtype']} "
                                     f"{s['shape']} in {path}, {str(b.dtype).removeprefix('torch.')} "
                                     f"{list(b.shape)} in the model")
        for name, b in have.items():
            s = state[name]
            dtype = b.dtype
            raw = base64.b64decode(s["data"])
            src = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(s["shape"])
                   if raw else torch.empty(s["shape"], dtype=dtype))
            with torch.no_grad():
                b.copy_(src)

    def stats(self):
        s = _lib.EngineStats()
        s.struct_size = ctypes.sizeof(s)
        self._call(_lib.strata_engine_stats, ctypes.byref(s))
        return {"tier_bytes": {"device": s.tier_bytes[1], "host": s.tier_bytes[2], "nvme": s.tier_bytes[3]},
                "nvme_read_bytes": s.nvme_read_bytes, "nvme_write_bytes": s.nvme_write_bytes, "steps": s.steps,
                "skipped_steps": s.skipped_steps,
                "comm_bytes": s.comm_bytes, "gathers_ahead": s.gathers_ahead, "gathers_reused": s.gathers_reused}

    def destroy(self):
        for h in getattr(self, "_hooks", []):
            h.remove()
        self._hooks = []
        lock = getattr(self, "_lock", None) or contextlib.nullcontext()
        with lock:
            device = None
            if getattr(self, "_cuda", False):
                try:  # best effort (at interpreter exit torch.cuda may be gone; the engine is freed anyway)
                    device = torch.cuda.device(self.device)
                    device.__enter__()
                except Exception:
                    device = None
            try:
                # Streams first (each waits for its work), then the engine.
                wrapped = getattr(self, "_wrapped", None) or {}
                for s, _ in wrapped.values():
                    _lib.strata_stream_destroy(s)
                wrapped.clear()
                if getattr(self, "_cuda", False):
                    self._s = None
                if getattr(self, "_s", None) is not None and self._s.value:
                    _lib.strata_stream_destroy(self._s)
                    self._s = None
                if getattr(self, "_e", None) is not None and self._e.value:
                    _lib.strata_engine_destroy(self._e)
                    self._e = None
            finally:
                if device is not None:
                    device.__exit__(None, None, None)

    def __del__(self):
        if getattr(self, "_owner_pid", os.getpid()) != os.getpid():
            return  # a forked child (a DataLoader worker) must not remove its parent's swap files
        try:
            self.destroy()
        except Exception:
            pass


def _group_lr_betas(gi, group, default_betas):
    """A param group's (lr, betas) as floats, or a ValueError naming the value the engine cannot take: lr a
    finite number >= 0 (the C ABI reads a negative one as "the config's"; torch would step with it, e.g. a
    linear decay run past its end), betas two numbers in [0, 1) (the CPU optimizer's range)."""
    lr = group["lr"]
    try:
        lr = float(lr.item() if torch.is_tensor(lr) else lr)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"strata.torch: param group {gi}'s lr is {group['lr']!r}, not a number ({e})") from None
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"strata.torch: param group {gi}'s lr is {lr}; the engine takes a finite lr >= 0 (a "
                         "schedule run past its end?)")
    betas = group.get("betas", default_betas)
    whose = f"param group {gi}'s betas are" if "betas" in group else "the config's optimizer.params.betas are"
    try:
        betas = tuple(float(b.item() if torch.is_tensor(b) else b) for b in betas)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"strata.torch: {whose} {group.get('betas', default_betas)!r}, not two numbers "
                         f"({e})") from None
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"strata.torch: {whose} {betas}; the engine takes two numbers in [0, 1)")
    return lr, betas


def _opt_number(params, key, default):
    """optimizer.params[key] as a float, refused naming the key when it is not a number ("auto": a Hugging
    Face Trainer placeholder that StrataTrainer fills in)."""
    v = params.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        hint = (": a Hugging Face Trainer placeholder (StrataTrainer fills it in); give the value"
                if v == "auto" else "")
        raise ValueError(f"strata.torch.initialize: config optimizer.params.{key} is {v!r}, not a number{hint}")
    return float(v)


def _enabled(cfg, section):
    """A precision section's "enabled" as the engine and DeepSpeed read it: true is on; false, null, absent and
    "auto" (the Hugging Face placeholder: DeepSpeed's default) are off."""
    sec = cfg.get(section)
    if sec is None:
        return False
    if not isinstance(sec, dict):
        raise ValueError(f"strata.torch: config \"{section}\" is {sec!r}, not an object")
    v = sec.get("enabled")
    if v is None or v is False or v == "auto":
        return False
    if v is True:
        return True
    raise ValueError(f"strata.torch: config {section}.enabled is {v!r}: true, false or \"auto\"")


def _precision(cfg):
    """The compute dtype a DeepSpeed config asks for: bf16 (its section "bf16", or DeepSpeed's older name
    "bfloat16"), fp16, else fp32."""
    if "bf16" in cfg and "bfloat16" in cfg:
        raise ValueError("strata.torch: config has both \"bf16\" and \"bfloat16\" (DeepSpeed's older name for "
                         "it); keep one")
    if _enabled(cfg, "bfloat16" if "bfloat16" in cfg else "bf16"):
        return torch.bfloat16
    return torch.float16 if _enabled(cfg, "fp16") else torch.float32


def _auto_cast(cfg):
    """fp16.auto_cast: DeepSpeed's engine(...) casts its floating-point positional inputs (in lists, tuples and
    dicts too) to fp16; keyword arguments and model(...) called directly are left as they are, as there."""
    section = cfg.get("fp16", {})
    value = section.get("auto_cast", False) if isinstance(section, dict) else False
    if not isinstance(value, bool):
        raise ValueError(f"strata.torch: fp16.auto_cast is {value!r}: true or false")
    if value and not _enabled(cfg, "fp16"):
        raise ValueError("strata.torch: fp16.auto_cast casts the inputs to fp16, but fp16 is not enabled (the model "
                         "computes in " + ("bf16" if _precision(cfg) == torch.bfloat16 else "fp32") +
                         "): drop auto_cast or enable fp16")
    return value


def _cast_half(inputs):
    if isinstance(inputs, (list, tuple)):
        cast = [_cast_half(v) for v in inputs]
        return type(inputs)(*cast) if hasattr(inputs, "_fields") else type(inputs)(cast)  # a namedtuple too
    if isinstance(inputs, dict):
        return {k: _cast_half(v) for k, v in inputs.items()}
    if torch.is_tensor(inputs) and inputs.is_floating_point():
        return inputs.half()
    return inputs


_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _running_calls(module):
    """How many calls of `module` are running on this thread's stack (frames of Module._call_impl)."""
    n = 0
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is _CALL_IMPL and f.f_locals.get("self") is module:
            n += 1
        f = f.f_back
    return n


_TYPE_TAG = "__strata_type__"


def _encode_state(value, what):
    """A torch scheduler's state_dict as JSON that decodes to an equal value: dicts with keys that are not
    strings (MultiStepLR's milestones, a Counter of ints), tuples and non-finite floats (ReduceLROnPlateau's
    best = inf) carry a type tag; anything else JSON cannot hold is refused naming `what` (DeepSpeed pickles
    it; Strata's checkpoints hold no pickles)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_TYPE_TAG: "float", "value": repr(value)}
    if isinstance(value, (list, tuple)):
        items = [_encode_state(v, what) for v in value]
        return items if type(value) is list else {_TYPE_TAG: "tuple", "items": items}
    if isinstance(value, dict):
        kind = {dict: "dict", collections.Counter: "Counter", collections.OrderedDict: "OrderedDict"}.get(type(value))
        if kind is None:
            raise TypeError(f"strata.torch: save_checkpoint: {what} holds a {type(value).__name__}, which a "
                            "checkpoint cannot store (JSON with plain dicts, Counter and OrderedDict only)")
        if kind == "dict" and all(isinstance(k, str) for k in value) and _TYPE_TAG not in value:
            return {k: _encode_state(v, what) for k, v in value.items()}
        return {_TYPE_TAG: kind, "items": [[_encode_state(k, what), _encode_state(v, what)] for k, v in value.items()]}
    raise TypeError(f"strata.torch: save_checkpoint: {what} holds a {type(value).__name__} ({value!r:.80}), which "
                    "a checkpoint cannot store (Strata stores it as JSON, not pickle)")


def _decode_state(value):
    if isinstance(value, list):
        return [_decode_state(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(_TYPE_TAG)
    if kind is None:
        return {k: _decode_state(v) for k, v in value.items()}
    if kind == "float":
        return float(value["value"])
    if kind == "tuple":
        return tuple(_decode_state(v) for v in value["items"])
    out = {"dict": dict, "Counter": collections.Counter, "OrderedDict": collections.OrderedDict}[kind]()
    for k, v in value["items"]:  # not cls(pairs): a Counter would count the pairs
        out[_decode_state(k)] = _decode_state(v)
    return out


def _check_finite(value, path):
    """NaN or infinity anywhere in the config, refused naming where (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"strata.torch.initialize: {path} is {value}: not a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_finite(v, f"{path}[{i}]")


# Engines still alive at interpreter exit (the model's hooks keep an engine
# alive as long as the model, and __del__ is not promised at exit) are
# destroyed then, so a script that never calls destroy() (DeepSpeed's API has
# none to call) leaves no swap files on the NVMe.
_LIVE_ENGINES = weakref.WeakSet()


@atexit.register
def _destroy_live_engines():
    for engine in list(_LIVE_ENGINES):
        if getattr(engine, "_owner_pid", None) == os.getpid():
            try:
                engine.destroy()
            except Exception:
                pass


def register_external_parameter(module, parameter):
    """DeepSpeed's deepspeed.zero.register_external_parameter: `module`'s forward
    uses `parameter`, which another module owns (a parent calling
    F.linear(x, self.child.weight), a hand-written tied head
    `h @ self.embed.weight.t()`). The engine then holds the parameter during
    `module`'s forward as it does for its owner's. Call it before or after
    initialize(); nn.MultiheadAttention's out_proj is registered by itself."""
    if not isinstance(module, torch.nn.Module) or not isinstance(parameter, torch.nn.Parameter):
        raise TypeError("strata.torch.register_external_parameter(module, parameter): a torch.nn.Module and one "
                        "of the model's torch.nn.Parameter")
    external = module.__dict__.setdefault("_strata_external", [])
    if not any(q is parameter for q in external):
        external.append(parameter)
    ref = getattr(parameter, "_strata_engine", None)
    engine = ref() if ref is not None else None
    if engine is not None:
        with engine._driving():
            engine._add_external(module, engine._group_of[engine._pid[id(parameter)]])


def initialize(model=None, model_parameters=None, config=None, lr_scheduler=None, optimizer=None, mpi_comm=None,
               **unsupported):
    """DeepSpeed's initialize(): returns (engine, optimizer, None, lr_scheduler).

    config: a DeepSpeed config dict or JSON path; zero_optimization.offload_param /
    offload_optimizer, aio, optimizer (AdamW), gradient_accumulation_steps,
    gradient_clipping, bf16/fp16 and scheduler (DeepSpeed's WarmupLR,
    WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest: strata.torch.lr_schedules)
    mean what they mean in DeepSpeed, plus Strata's own "strata" section
    (docs/config.md). lr_scheduler: a torch scheduler (or a callable taking the
    returned optimizer) instead of the config's; either is stepped after each
    optimizer step the engine takes (not after one skipped for non-finite
    gradients) and is the 4th value returned.

    Ranks: under `mpirun -np N` (or with mpi_comm=, an mpi4py communicator or
    its Fortran handle), or under torchrun (`torchrun --nproc-per-node N`, CPU
    ranks over TCP; GPU ranks over NCCL) every process is one data-parallel
    rank of one engine
    (ZeRO stage 3, or 1-2 from the config): each rank passes its own
    micro-batches and the step averages the gradients over all ranks; every
    rank must run the same model through the same calls (docs/python.md).
    """
    if unsupported:
        raise TypeError(f"strata.torch.initialize: {sorted(unsupported)} not supported")
    if optimizer is not None:
        raise ValueError("strata.torch.initialize: the optimizer comes from the config's \"optimizer\" section "
                         "(Strata's AdamW runs inside the engine); do not pass a torch optimizer")
    engine = StrataEngine(model, model_parameters, config, lr_scheduler=lr_scheduler, mpi_comm=mpi_comm)
    return engine, engine.optimizer, None, engine.lr_scheduler
