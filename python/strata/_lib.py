"""ctypes bindings of Strata's C ABI (include/strata/strata.h).

Only what the Python package uses is declared. The library is found, in
order: $STRATA_LIBRARY (a path to libstrata.so), the package's own
strata/lib/libstrata.so (what `pip install .` puts there), else an ImportError
naming both. Every call that fails raises StrataError carrying the C
library's message and status.
"""
import ctypes
import os
import threading

__all__ = ["lib", "StrataError", "check", "library_path", "DTYPE_F32", "DTYPE_BF16", "DTYPE_F16"]

API_VERSION = 12  # STRATA_API_VERSION these bindings speak

DTYPE_F32, DTYPE_BF16, DTYPE_F16 = 0, 1, 2
DEVICE_AUTO, DEVICE_CUDA, DEVICE_HOST = 0, 1, 2
COMM_NONE, COMM_MPI, COMM_NCCL, COMM_TCP = 0, 1, 2, 3  # strata_comm_kind_t
OPT_ADAMW, OPT_ADAM = 0, 1
ISA_AUTO = 0
MAX_DIMS = 8

STATUS_NAMES = {0: "OK", 1: "INVALID_ARGUMENT", 2: "IO", 3: "NO_SPACE", 4: "OUT_OF_BUDGET", 5: "OUT_OF_MEMORY",
                6: "NOT_FOUND", 7: "PERMISSION", 8: "UNAVAILABLE", 9: "CORRUPT", 10: "ALREADY_EXISTS",
                11: "CANCELLED", 12: "INTERNAL"}


class StrataError(RuntimeError):
    """A Strata call failed: `status` is the C status name ("INVALID_ARGUMENT", ...),
    the message is the library's (what, where and why)."""

    def __init__(self, status, message):
        self.status = STATUS_NAMES.get(status, str(status))
        super().__init__(f"{message} [{self.status}]")


def library_path():
    env = os.environ.get("STRATA_LIBRARY")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "libstrata.so")


def _load():
    path = library_path()
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(f"strata: cannot load the C library {path} ({e}); install the package with "
                          "`pip install .` from a Strata clone, or point STRATA_LIBRARY at a libstrata.so") from e


lib = _load()

c_void_p, c_char_p, c_int, c_int32, c_uint32, c_uint64, c_int64, c_size_t, c_double = (
    ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int32, ctypes.c_uint32, ctypes.c_uint64,
    ctypes.c_int64, ctypes.c_size_t, ctypes.c_double)


class EngineOptions(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("config_json", c_char_p), ("config_path", c_char_p),
                ("device_kind", c_int), ("device_ordinal", c_int), ("comm_kind", c_int), ("mpi_comm", c_int64),
                ("comm_timeout_s", c_double), ("nccl_comm", c_void_p), ("comm_rank", c_int32),
                ("comm_world_size", c_int32), ("comm_store_addr", c_char_p), ("comm_store_port", c_int32),
                ("cancel", ctypes.POINTER(c_int))]


class ParamDesc(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("name", c_char_p), ("group", c_char_p), ("ndim", c_uint32),
                ("shape", c_uint64 * MAX_DIMS), ("dtype", c_int), ("frozen", c_int32),
                ("no_weight_decay", c_int32), ("lr_group", c_uint32)]


class StepResult(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("step", c_int64), ("skipped", c_int), ("skipped_groups", c_uint32),
                ("grad_norm", c_double), ("clip_coef", c_double), ("loss_scale", c_double), ("lr", c_double),
                ("seconds", c_double)]


class EngineStats(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("tier_bytes", c_uint64 * 4), ("device_buffer_bytes", c_uint64),
                ("pinned_bytes", c_uint64), ("nvme_read_bytes", c_uint64), ("nvme_write_bytes", c_uint64),
                ("h2d_bytes", c_uint64), ("d2h_bytes", c_uint64), ("acquires", c_uint64),
                ("prefetch_hits", c_uint64), ("prefetch_misses", c_uint64), ("order_changes", c_uint64),
                ("hot_path_allocs", c_uint64), ("steps", c_int64), ("skipped_steps", c_int64),
                ("comm_bytes", c_uint64), ("gathers_ahead", c_uint64),
                ("gathers_reused", c_uint64)]


class OptimizerConfig(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("kind", c_int), ("lr", c_double), ("beta1", c_double),
                ("beta2", c_double), ("eps", c_double), ("weight_decay", c_double), ("amsgrad", c_int),
                ("momentum", c_double), ("dampening", c_double), ("nesterov", c_int), ("lr_decay", c_double),
                ("maximize", c_int), ("grad_scale", c_double)]


class OptimizerBuffers(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("params", c_void_p), ("grads", c_void_p), ("grad_dtype", c_int),
                ("state", c_void_p * 3), ("state_dtype", c_int), ("params_out", c_void_p), ("out_dtype", c_int)]


def _fn(name, restype, *argtypes):
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


strata_api_version = _fn("strata_api_version", c_int)
strata_last_error = _fn("strata_last_error", c_char_p)
strata_version = _fn("strata_version", c_char_p)
strata_free = _fn("strata_free", None, c_void_p)
# CPU optimizers
strata_optimizer_config_init = _fn("strata_optimizer_config_init", c_int, c_int, ctypes.POINTER(OptimizerConfig))
strata_cpu_optimizer_create = _fn("strata_cpu_optimizer_create", c_int, c_int, c_int, ctypes.POINTER(c_void_p))
strata_cpu_optimizer_destroy = _fn("strata_cpu_optimizer_destroy", None, c_void_p)
strata_cpu_optimizer_step = _fn("strata_cpu_optimizer_step", c_int, c_void_p, ctypes.POINTER(OptimizerConfig),
                                c_int64, ctypes.POINTER(OptimizerBuffers), c_size_t)
strata_cpu_optimizer_last_error = _fn("strata_cpu_optimizer_last_error", c_char_p, c_void_p)
# The engine
strata_engine_options_init = _fn("strata_engine_options_init", c_int, ctypes.POINTER(EngineOptions))
strata_engine_create = _fn("strata_engine_create", c_int, ctypes.POINTER(EngineOptions), ctypes.POINTER(ParamDesc),
                           c_size_t, ctypes.POINTER(c_void_p))
strata_engine_destroy = _fn("strata_engine_destroy", None, c_void_p)
strata_engine_last_error = _fn("strata_engine_last_error", c_char_p, c_void_p)
strata_engine_find_group = _fn("strata_engine_find_group", c_int, c_void_p, c_char_p, ctypes.POINTER(c_uint32))
strata_engine_load_param = _fn("strata_engine_load_param", c_int, c_void_p, c_uint32, c_void_p, c_int, c_size_t)
strata_engine_read_param = _fn("strata_engine_read_param", c_int, c_void_p, c_uint32, c_void_p, c_int, c_size_t)
strata_engine_broadcast = _fn("strata_engine_broadcast", c_int, c_void_p, c_void_p, c_size_t, c_uint32)
strata_engine_ranks = _fn("strata_engine_ranks", c_int, c_void_p, ctypes.POINTER(c_uint32), ctypes.POINTER(c_uint32))
strata_engine_read_state = _fn("strata_engine_read_state", c_int, c_void_p, c_uint32, c_int, c_void_p, c_size_t)
strata_engine_load_state = _fn("strata_engine_load_state", c_int, c_void_p, c_uint32, c_int, c_void_p, c_size_t)
strata_engine_param_steps = _fn("strata_engine_param_steps", c_int, c_void_p, c_uint32, ctypes.POINTER(c_int64))
strata_engine_set_param_steps = _fn("strata_engine_set_param_steps", c_int, c_void_p, c_uint32, c_int64)
strata_engine_begin_micro_batch = _fn("strata_engine_begin_micro_batch", c_int, c_void_p, c_int)
strata_engine_acquire = _fn("strata_engine_acquire", c_int, c_void_p, c_uint32, c_void_p, ctypes.POINTER(c_void_p),
                            c_size_t, ctypes.POINTER(c_size_t))
strata_engine_release = _fn("strata_engine_release", c_int, c_void_p, c_uint32, c_void_p)
strata_engine_reduce_grad = _fn("strata_engine_reduce_grad", c_int, c_void_p, c_uint32, c_void_p, c_int, c_void_p)
strata_engine_discard_step = _fn("strata_engine_discard_step", c_int, c_void_p, c_void_p)
strata_engine_step = _fn("strata_engine_step", c_int, c_void_p, c_double, ctypes.POINTER(StepResult))
strata_engine_synchronize = _fn("strata_engine_synchronize", c_int, c_void_p)
strata_engine_set_lr = _fn("strata_engine_set_lr", c_int, c_void_p, c_double)
strata_engine_set_group_betas = _fn("strata_engine_set_group_betas", c_int, c_void_p, c_uint32, c_double, c_double)
strata_engine_set_group_lr = _fn("strata_engine_set_group_lr", c_int, c_void_p, c_uint32, c_double)
strata_engine_step_count = _fn("strata_engine_step_count", c_int, c_void_p, ctypes.POINTER(c_int64))
strata_engine_save_checkpoint = _fn("strata_engine_save_checkpoint", c_int, c_void_p, c_char_p, c_char_p)
strata_engine_load_checkpoint = _fn("strata_engine_load_checkpoint", c_int, c_void_p, c_char_p,
                                    ctypes.POINTER(c_void_p))
strata_engine_stats = _fn("strata_engine_stats", c_int, c_void_p, ctypes.POINTER(EngineStats))
strata_engine_param_dlpack = _fn("strata_engine_param_dlpack", c_int, c_void_p, c_uint32, ctypes.POINTER(c_void_p))
strata_engine_reduce_grad_dlpack = _fn("strata_engine_reduce_grad_dlpack", c_int, c_void_p, c_uint32, c_void_p,
                                       c_void_p)
strata_stream_create = _fn("strata_stream_create", c_int, c_void_p, c_char_p, ctypes.POINTER(c_void_p))
strata_stream_wrap = _fn("strata_stream_wrap", c_int, c_void_p, c_void_p, ctypes.POINTER(c_void_p))
strata_stream_destroy = _fn("strata_stream_destroy", c_int, c_void_p)
strata_stream_synchronize = _fn("strata_stream_synchronize", c_int, c_void_p)

if strata_api_version() != API_VERSION:
    raise ImportError(f"strata: {library_path()} implements C API version {strata_api_version()}, these bindings "
                      f"speak {API_VERSION}: reinstall the package from the same clone")


def check(status, engine=None):
    """Raises StrataError for a failed call, with the engine's (or the thread's) message."""
    if status == 0:
        return
    msg = strata_engine_last_error(engine) if engine else strata_last_error()
    raise StrataError(status, (msg or b"").decode("utf-8", "replace"))


def create_engine(opts, descs, count):
    """strata_engine_create: the engine handle (a c_void_p), or StrataError.

    With ranks (TCP, NCCL) the call waits for the other ranks, up to the
    timeout (minutes). Python runs a signal handler only between bytecodes, so
    Ctrl-C during a call into C would wait for all of it: the call runs on a
    thread of its own instead, and when this thread is interrupted (a
    KeyboardInterrupt, or any exception raised by a signal handler) it sets
    the call's stop flag (strata_engine_options_t.cancel, API 12), which ends
    the wait within 100 ms of the C library's polls, waits for the call to
    return, and raises the interruption here, leaving no engine behind. A
    second interruption raises at once: the call then finishes on its own
    thread, which destroys the engine if it made one."""
    e = c_void_p()
    # Under mpirun (MPI, or NCCL whose id travels over MPI) the call stays on
    # this thread, where MPI is initialised; mpirun ends its ranks on Ctrl-C.
    mpirun = os.environ.get("OMPI_COMM_WORLD_SIZE") is not None and opts.comm_world_size == 0
    if opts.comm_kind not in (COMM_TCP, COMM_NCCL) or (opts.comm_kind == COMM_NCCL and mpirun):
        check(strata_engine_create(ctypes.byref(opts), descs, count, ctypes.byref(e)))
        return e
    stop = c_int(0)
    opts.cancel = ctypes.pointer(stop)
    lock = threading.Lock()
    done = {}  # under lock: "status" and "message", or "error"; "abandoned" once the caller left

    def create():
        try:
            status = strata_engine_create(ctypes.byref(opts), descs, count, ctypes.byref(e))
            message = (strata_last_error() or b"").decode("utf-8", "replace") if status else ""  # this thread's
        except BaseException as ex:  # noqa: BLE001 - handed to the caller
            with lock:
                done["error"] = ex
            return
        with lock:
            done["status"], done["message"] = status, message
            if status == 0 and done.get("abandoned"):
                strata_engine_destroy(e)

    t = threading.Thread(target=create, name="strata-engine-create", daemon=True)
    t.start()
    try:
        while t.is_alive():
            t.join(0.1)  # interruptible: a signal's exception is raised here
    except BaseException:
        stop.value = 1
        try:
            while t.is_alive():
                t.join(0.1)
        finally:  # also when a second interruption ends the wait
            with lock:
                done["abandoned"] = True
                made = done.get("status") == 0
            if made:  # it had already met the others
                strata_engine_destroy(e)
        raise
    if "error" in done:
        raise done["error"]
    if done["status"] != 0:
        raise StrataError(done["status"], done["message"])
    return e

strata_engine_loss_scale = _fn("strata_engine_loss_scale", c_int, c_void_p, ctypes.POINTER(c_double))


# ---------------------------------------------------------------- DLPack capsules
# The exchange torch.utils.dlpack (and JAX, CuPy) speak: a PyCapsule named
# "dltensor" holding a DLManagedTensor*; the consumer renames it
# "used_dltensor" and owns the tensor from then on.

class _DLManagedTensorHead(ctypes.Structure):
    # DLTensor (48 bytes) then manager_ctx and deleter: only the deleter is read here.
    _fields_ = [("dl_tensor", ctypes.c_byte * 48), ("manager_ctx", c_void_p),
                ("deleter", ctypes.CFUNCTYPE(None, c_void_p))]


_DLTENSOR = ctypes.create_string_buffer(b"dltensor")
_USED_DLTENSOR = ctypes.create_string_buffer(b"used_dltensor")
_api = ctypes.pythonapi
_capsule_new = _api.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = ctypes.py_object, [c_void_p, c_void_p, c_void_p]
_capsule_get = _api.PyCapsule_GetPointer
_capsule_get.restype, _capsule_get.argtypes = c_void_p, [ctypes.py_object, c_void_p]
_capsule_set_name = _api.PyCapsule_SetName
_capsule_set_name.restype, _capsule_set_name.argtypes = c_int, [ctypes.py_object, c_void_p]
_capsule_is_valid = _api.PyCapsule_IsValid
_capsule_is_valid.restype, _capsule_is_valid.argtypes = c_int, [c_void_p, c_void_p]
_capsule_get_raw = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_void_p)(("PyCapsule_GetPointer", _api))


@ctypes.PYFUNCTYPE(None, c_void_p)
def _unconsumed_capsule(capsule):
    # A capsule nobody consumed still owns its tensor: free it.
    if _capsule_is_valid(capsule, ctypes.addressof(_DLTENSOR)):
        ptr = _capsule_get_raw(capsule, ctypes.addressof(_DLTENSOR))
        head = _DLManagedTensorHead.from_address(ptr)
        if head.deleter:
            head.deleter(ptr)


def param_capsule(engine, param):
    """A DLPack capsule viewing `param` of a held group (strata_engine_param_dlpack)."""
    ptr = c_void_p()
    check(strata_engine_param_dlpack(engine, param, ctypes.byref(ptr)), engine)
    return _capsule_new(ptr, ctypes.addressof(_DLTENSOR), ctypes.cast(_unconsumed_capsule, c_void_p))


def reduce_grad_capsule(engine, param, capsule, stream):
    """Hands a DLPack capsule's tensor to strata_engine_reduce_grad_dlpack; on
    success the engine owns it (the capsule is marked used)."""
    ptr = _capsule_get(capsule, ctypes.addressof(_DLTENSOR))
    check(strata_engine_reduce_grad_dlpack(engine, param, ptr, stream), engine)
    _capsule_set_name(capsule, ctypes.addressof(_USED_DLTENSOR))
