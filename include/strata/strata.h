/*
 * strata.h: the C ABI of Strata, the contract for trainers that link it.
 *
 * Conventions (they hold for every function below):
 *  - Every call that can fail returns strata_status_t; STRATA_OK is 0. Outputs
 *    are the last pointer arguments and are written only on success.
 *  - strata_status_string() names a status; the text of the most recent error
 *    (what failed, where, why) is available per handle where there is one, and
 *    per thread from strata_last_error() for calls without a handle.
 *  - Config structs start with their size (set it to sizeof(the struct)), so
 *    fields can be appended in later versions without breaking callers built
 *    against this header. Zero-initialise and set what you need: every field
 *    documents the meaning of 0.
 *  - No C++ types cross this boundary; the library exports only strata_*.
 *  - Nothing aborts on bad input: invalid arguments return
 *    STRATA_ERR_INVALID_ARGUMENT with a message.
 */
#ifndef STRATA_STRATA_H_
#define STRATA_STRATA_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define STRATA_API
#else
#define STRATA_API __attribute__((visibility("default")))
#endif

#define STRATA_API_VERSION 12

/* ------------------------------------------------------------------ status */

typedef enum strata_status {
  STRATA_OK = 0,
  STRATA_ERR_INVALID_ARGUMENT = 1, /* bad input from the caller or a config file */
  STRATA_ERR_IO = 2,               /* an I/O call failed (EIO, EBADF, ...) */
  STRATA_ERR_NO_SPACE = 3,         /* disk full */
  STRATA_ERR_OUT_OF_BUDGET = 4,    /* a configured memory budget would be exceeded */
  STRATA_ERR_OUT_OF_MEMORY = 5,    /* the system refused memory */
  STRATA_ERR_NOT_FOUND = 6,
  STRATA_ERR_PERMISSION = 7,
  STRATA_ERR_UNAVAILABLE = 8, /* a feature is missing here (no GPU, io_uring disabled, ISA absent) */
  STRATA_ERR_CORRUPT = 9,     /* data failed a check (checksum, bounds) */
  STRATA_ERR_ALREADY_EXISTS = 10,
  STRATA_ERR_CANCELLED = 11,
  STRATA_ERR_INTERNAL = 12 /* a bug in Strata: please report it with the message */
} strata_status_t;

/* "STRATA_OK", "STRATA_ERR_IO", ...; never NULL. Thread-safe. */
STRATA_API const char* strata_status_string(strata_status_t status);

/* The message of the last failed call on this thread that has no handle
 * ("" if none). Valid until the next failing call on this thread. */
STRATA_API const char* strata_last_error(void);

/* "0.1.0 (commit ..., RelWithDebInfo)". Static storage; thread-safe. */
STRATA_API const char* strata_version(void);

/* The API version this library implements (STRATA_API_VERSION it was built with). */
STRATA_API int strata_api_version(void);

/* ------------------------------------------------------------------ dtypes */

typedef enum strata_dtype {
  STRATA_DTYPE_F32 = 0,
  STRATA_DTYPE_BF16 = 1, /* bfloat16, rounded to nearest even */
  STRATA_DTYPE_F16 = 2   /* IEEE binary16 */
} strata_dtype_t;

/* ------------------------------------------------------------------ CPU optimizers
 *
 * Strata's vectorized, multithreaded CPU optimizers, usable on their own by a
 * trainer that keeps fp32 master weights in host memory. Semantics are
 * PyTorch's (torch.optim.AdamW / Adam / Adagrad / SGD; Lion as published).
 * Results are bit-identical for any thread count and instruction set.
 */

typedef enum strata_optimizer_kind {
  STRATA_OPTIMIZER_ADAMW = 0,   /* decoupled weight decay */
  STRATA_OPTIMIZER_ADAM = 1,    /* weight decay as L2 in the gradient */
  STRATA_OPTIMIZER_ADAGRAD = 2,
  STRATA_OPTIMIZER_LION = 3,
  STRATA_OPTIMIZER_SGD = 4      /* momentum, dampening, Nesterov */
} strata_optimizer_kind_t;

typedef enum strata_isa {
  STRATA_ISA_AUTO = 0, /* STRATA_CPU_ISA if set, else the best this CPU supports */
  STRATA_ISA_SCALAR = 1,
  STRATA_ISA_AVX2 = 2,
  STRATA_ISA_AVX512 = 3,
  STRATA_ISA_NEON = 4
} strata_isa_t;

/* Hyper-parameters of one step; all may change between calls (schedulers).
 * Fill with strata_optimizer_config_init(), which sets PyTorch's defaults,
 * then change what you need. */
typedef struct strata_optimizer_config {
  size_t struct_size; /* sizeof(strata_optimizer_config_t) */
  strata_optimizer_kind_t kind;
  double lr;
  double beta1, beta2;  /* Adam/AdamW/Lion */
  double eps;           /* Adam/AdamW/Adagrad */
  double weight_decay;  /* decoupled for AdamW and Lion, L2 otherwise */
  int amsgrad;          /* Adam/AdamW: nonzero needs state[2] */
  double momentum;      /* SGD */
  double dampening;     /* SGD */
  int nesterov;         /* SGD */
  double lr_decay;      /* Adagrad */
  int maximize;         /* nonzero: ascend */
  double grad_scale;    /* multiplies every gradient: 1/loss_scale * 1/accumulation steps */
} strata_optimizer_config_t;

/* The buffers of one step, `count` elements each, owned by the caller and
 * valid for the duration of the call only. States start zeroed (Adagrad's
 * sum: its initial accumulator value) and are updated in place:
 *   Adam/AdamW: state[0] exp_avg, state[1] exp_avg_sq, state[2] max_exp_avg_sq (amsgrad)
 *   Adagrad: state[0] sum;  Lion: state[0] exp_avg;  SGD: state[0] momentum (if momentum != 0)
 * params_out, when not NULL, receives the updated parameters rounded to
 * out_dtype (BF16 or F16) in the same pass: the compute copy for the GPU. */
typedef struct strata_optimizer_buffers {
  size_t struct_size; /* sizeof(strata_optimizer_buffers_t) */
  float* params;      /* fp32 master weights, updated in place */
  const void* grads;
  strata_dtype_t grad_dtype;  /* F32, BF16 or F16 */
  void* state[3];
  strata_dtype_t state_dtype; /* F32 or BF16 */
  void* params_out;           /* optional */
  strata_dtype_t out_dtype;   /* BF16 or F16 */
} strata_optimizer_buffers_t;

typedef struct strata_cpu_optimizer* strata_cpu_optimizer_t;

/* Fills *config with PyTorch's defaults for `kind` and sets struct_size:
 * AdamW lr 1e-3, betas 0.9/0.999, eps 1e-8, weight_decay 1e-2; Adam the same
 * with weight_decay 0; Adagrad lr 1e-2, eps 1e-10; Lion lr 1e-4, betas
 * 0.9/0.99; SGD lr 1e-3, no momentum; grad_scale 1 for all. Returns STRATA_ERR_INVALID_ARGUMENT for
 * a NULL config or an unknown kind. */
STRATA_API strata_status_t strata_optimizer_config_init(strata_optimizer_kind_t kind,
                                                        strata_optimizer_config_t* config);

/* Number of state buffers `config` needs (0..3) in *count. */
STRATA_API strata_status_t strata_optimizer_state_count(const strata_optimizer_config_t* config, int* count);

/* Creates an optimizer executor: which ISA (STRATA_ISA_AUTO: best) and how
 * many threads (0: the cores this process may use, or STRATA_THREADS; at most
 * 65536, else STRATA_ERR_INVALID_ARGUMENT).
 * Returns STRATA_ERR_UNAVAILABLE when `isa` cannot run on this CPU. The handle
 * is owned by the caller (strata_cpu_optimizer_destroy). A handle may be used
 * from one thread at a time; separate handles are independent. */
STRATA_API strata_status_t strata_cpu_optimizer_create(strata_isa_t isa, int threads, strata_cpu_optimizer_t* out);

/* Frees the handle (NULL is fine). */
STRATA_API void strata_cpu_optimizer_destroy(strata_cpu_optimizer_t opt);

/* One optimizer step over `count` elements; `step` is 1 on the first call
 * (PyTorch's state['step'] after increment): Adam's bias correction uses it,
 * and SGD with momentum overwrites its momentum buffer with the gradient at
 * step 1 (torch's first step), so a caller must count steps, not pass 1
 * each time. Synchronous: it returns when all buffers are updated. Nothing
 * is modified when it fails: STRATA_ERR_INVALID_ARGUMENT for missing
 * buffers, bad dtypes, step < 1 or hyper-parameters PyTorch would reject
 * (negative, NaN, or past fp32's range). bf16 states round to nearest even
 * here (the engine alone offers stochastic rounding:
 * strata.optimizer_state_rounding). */
STRATA_API strata_status_t strata_cpu_optimizer_step(strata_cpu_optimizer_t opt,
                                                     const strata_optimizer_config_t* config, int64_t step,
                                                     const strata_optimizer_buffers_t* buffers, size_t count);

/* One pass over the gradients: the squared L2 norm of (grad_scale * g) in
 * *sum_sq and whether any element is inf or NaN in *has_inf_nan (for
 * clipping and for skipping an overflowed fp16 step). Deterministic. */
STRATA_API strata_status_t strata_cpu_grad_stats(strata_cpu_optimizer_t opt, const void* grads,
                                                 strata_dtype_t dtype, size_t count, double grad_scale,
                                                 double* sum_sq, int* has_inf_nan);

/* The message of the last failed call on this handle ("" if none). Valid
 * until the next call on the handle. */
STRATA_API const char* strata_cpu_optimizer_last_error(strata_cpu_optimizer_t opt);

/* ------------------------------------------------------------------ memory */

/* Frees memory this library allocated for the caller (the functions that do
 * so say "free with strata_free"). NULL is fine. Thread-safe. */
STRATA_API void strata_free(void* ptr);

/* ------------------------------------------------------------------ the offload engine
 *
 * The runtime a trainer drives (docs/architecture.md): it owns the model's
 * training state (compute copies, fp32 masters, optimizer states, fp32
 * gradient accumulators), places each on a home tier (device / host RAM /
 * NVMe) and moves it where the trainer needs it. One optimizer step:
 *
 *   for each micro-batch m:  strata_engine_begin_micro_batch(e, m == accum - 1)
 *     forward:  for g in groups:          acquire(g) -> device pointers; compute; release(g)
 *     backward: for g in reversed groups: acquire(g); compute grads;
 *                                         reduce_grad(p, grad) for p in g; release(g)
 *   strata_engine_step(e, lr, &result)
 *
 * Creation. The model (names, shapes, dtypes, groups) is fixed when the
 * engine is created, because the planner places all of it at once and every
 * buffer is allocated then: so strata_engine_create() takes the whole model as
 * an array of strata_param_desc_t in one call, rather than through a builder
 * that would add a half-built state the caller must track. Both structs are
 * versioned (struct_size first), so new per-engine or per-parameter fields
 * can be appended: since API 7 a struct that grew (strata_engine_options_t,
 * strata_engine_stats_t) is also taken at its API 6 size, for callers that
 * fill it by hand, the fields past struct_size reading as their defaults
 * (options) or left unwritten (stats); any other smaller struct_size is
 * refused. strata_engine_options_init() writes the whole struct of the header
 * the library was built with, so a program built against another header
 * checks strata_api_version() first (the Python bindings refuse a mismatch).
 *
 * Ids. Parameters are numbered 0..param_count-1 in the order given at
 * creation; groups 0..group_count-1 in order of first appearance there.
 *
 * Streams. Work is ordered by device streams (strata_stream_t): acquire()
 * makes the caller's stream wait for the upload (an event, never a
 * device-wide sync); release() lets the buffers be reused once that stream
 * has passed this point; reduce_grad() reads the gradient once the stream
 * gets there (the buffer may be overwritten by work enqueued on that stream
 * after the call). On the cuda backend a trainer wraps its own stream
 * (strata_stream_wrap, e.g. PyTorch's current stream); on the host backend
 * "device memory" is RAM, streams are Strata's worker threads, and a C
 * trainer synchronizes the stream (or an event recorded on it) before
 * touching the memory from the CPU.
 *
 * Threads. The driving calls (every strata_engine_* call except those listed
 * next) must never overlap: one at a time, in the protocol's order. They
 * need not come from one thread: PyTorch runs backward hooks on its autograd
 * thread (for CUDA tensors, one thread per device) while forward hooks run
 * on the caller's, which is fine because the caller's thread is blocked in
 * backward() meanwhile; the engine takes no lock for them, so a trainer that
 * could overlap them must serialize them itself. Any thread may call, at any
 * time, concurrently with the driving calls: strata_engine_stats,
 * strata_engine_trace_begin / _end, the queries
 * about the model and plan, which are fixed at creation (counts, find_*,
 * param/group info, group_params, device, plan report), and the stream,
 * event and device-memory calls. A DLManagedTensor's deleter may run on any
 * thread. Different engines are independent.
 *
 * Errors. Every function returns strata_status_t and writes its outputs (the
 * last arguments) only on success. The message of a failed call on an engine
 * or one of its streams is strata_engine_last_error(engine), and also this
 * thread's strata_last_error(). A NULL engine or stream handle is
 * STRATA_ERR_INVALID_ARGUMENT with the message in strata_last_error().
 * No C++ exception leaves the library: an unexpected one becomes
 * STRATA_ERR_INTERNAL (STRATA_ERR_OUT_OF_MEMORY for a failed allocation).
 */

#define STRATA_MAX_DIMS 8

typedef struct strata_engine* strata_engine_t;
typedef struct strata_stream* strata_stream_t;
typedef struct strata_event* strata_event_t;

typedef enum strata_device_kind {
  STRATA_DEVICE_AUTO = 0, /* cuda when the CUDA module loads and sees a GPU, else host */
  STRATA_DEVICE_CUDA = 1, /* STRATA_ERR_UNAVAILABLE with the reason when it cannot */
  STRATA_DEVICE_HOST = 2  /* "device memory" is RAM; always available */
} strata_device_kind_t;

/* Data-parallel ranks (docs/comm.md): how an engine meets the other ranks. */
typedef enum strata_comm_kind {
  STRATA_COMM_NONE = 0, /* one rank */
  STRATA_COMM_MPI = 1,  /* one rank of an MPI communicator (strata_engine_options_t.mpi_comm) */
  STRATA_COMM_NCCL = 2, /* one GPU rank of the launcher's job, over NCCL (never run on a GPU yet) */
  STRATA_COMM_TCP = 3   /* one host rank of the launcher's torchrun-style job, over TCP sockets (API 9) */
} strata_comm_kind_t;

/* Home tiers; the values index strata_engine_stats_t.tier_bytes. */
typedef enum strata_tier {
  STRATA_TIER_AUTO = 0, /* not placed (never returned for a planned state) */
  STRATA_TIER_DEVICE = 1,
  STRATA_TIER_HOST = 2,
  STRATA_TIER_NVME = 3
} strata_tier_t;

/* The kinds of per-parameter state; index strata_group_info_t.tier. */
typedef enum strata_state_kind {
  STRATA_STATE_COMPUTE = 0,   /* the copy the device computes with (compute dtype) */
  STRATA_STATE_MASTER = 1,    /* fp32 master weights */
  STRATA_STATE_OPTIMIZER = 2, /* Adam m and v */
  STRATA_STATE_GRAD = 3       /* fp32 gradient accumulator */
} strata_state_kind_t;

typedef enum strata_copy_kind {
  STRATA_COPY_HOST_TO_DEVICE = 0,
  STRATA_COPY_DEVICE_TO_HOST = 1,
  STRATA_COPY_DEVICE_TO_DEVICE = 2
} strata_copy_kind_t;

/* How to create an engine. Fill with strata_engine_options_init(). */
typedef struct strata_engine_options {
  size_t struct_size; /* sizeof(strata_engine_options_t) */
  /* The config as JSON text: DeepSpeed's config format with Strata's
   * "strata" section (docs/config.md). Borrowed for the call only. NULL: read
   * config_path instead. Messages name it "<config_json>". */
  const char* config_json;
  /* A config file, read when config_json is NULL. Both NULL: every default
   * (no NVMe directory, budgets detected). Setting both is an error. */
  const char* config_path;
  strata_device_kind_t device_kind; /* 0: auto */
  int device_ordinal;               /* CUDA device; 0: the first. Ignored on the host backend. */
  /* Ranks (API 5). STRATA_COMM_MPI: this process is one rank of the MPI
   * communicator `mpi_comm`, given as its Fortran handle (MPI_Comm_c2f(comm)
   * in C, comm.py2f() in mpi4py; MPI must then be initialized by the caller)
   * or -1 for MPI_COMM_WORLD (MPI initialized by Strata if needed, e.g. under
   * mpirun). The engine works on its own duplicate, so its messages never
   * match the caller's. Every rank creates its engine with the same config and
   * parameters (strata_engine_create is then collective), and from then on
   * makes the same driving calls in the same order: they are collectives
   * (runtime/engine.h "Sharding and ranks"; zero_optimization.stage 3 shards
   * parameters too, 1-2 keep them whole on every rank). Each rank passes the
   * gradients of its own micro-batches; step() averages over all ranks'.
   * STRATA_COMM_MPI runs on the host device backend. STRATA_COMM_TCP (API
   * 9): this process is rank RANK of WORLD_SIZE host ranks as a torchrun-style
   * launcher says (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; the ranks meet
   * through the TCPStore there, torchrun's own or one rank 0 serves, then
   * over TCP connections between every pair of ranks); the host device
   * backend, device_kind AUTO or HOST. STRATA_COMM_NCCL: this
   * process is rank RANK of WORLD_SIZE GPU ranks as the launcher says
   * (torchrun style: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, rank 0's
   * NCCL id travelling through the TCPStore there: torchrun's own, or one
   * rank 0 serves where none listens; or mpirun, the id over MPI); the engine runs on the CUDA backend on device_ordinal (usually
   * LOCAL_RANK), one GPU per rank; device_kind must be AUTO or CUDA. It has
   * been compiled and tested on the host only: no GPU has run it yet. A peer
   * that stops taking part fails the call after comm_timeout_s seconds
   * (0: 300; at most 1e7) with STRATA_ERR_UNAVAILABLE naming it (MPI, TCP) or the
   * collective (NCCL); over TCP a peer whose process ended fails it at once,
   * naming the rank. */
  strata_comm_kind_t comm_kind;
  int64_t mpi_comm;
  double comm_timeout_s;
  /* STRATA_COMM_NCCL only (API 7): the trainer's own ncclComm_t, instead of a
   * bootstrap from the launcher's environment. The engine makes its own child
   * communicator of it (ncclCommSplit: every rank of that communicator calls
   * strata_engine_create, which is then collective over them; rank and world
   * size are the communicator's), so the engine's collectives never mix with
   * the trainer's and a timeout aborts only the child. The communicator's GPU
   * must be device_ordinal. Borrowed for the call only. NULL: bootstrap.
   * Never run on a GPU yet. */
  void* nccl_comm;
  /* STRATA_COMM_TCP and STRATA_COMM_NCCL (API 10): the ranks as the caller's
   * own process group has them, instead of the launcher's environment: this
   * process is rank `comm_rank` of `comm_world_size`, and the ranks meet
   * through the TCPStore (torch's protocol) at comm_store_addr:comm_store_port,
   * e.g. the store of torch.distributed's default process group (tcp:// or
   * env:// init_method) in processes started by torch.multiprocessing.spawn
   * or a launcher of the trainer's own, without RANK and WORLD_SIZE in their
   * environment. The engine adds its own keys there ("tcp/...", "nccl/..."),
   * never touching the group's. comm_world_size 0: the environment (as
   * before API 10); otherwise 0 <= comm_rank < comm_world_size and, with
   * more than one rank, a store address (borrowed for the call) and port
   * 1..65535. Refused with STRATA_COMM_NONE, STRATA_COMM_MPI and nccl_comm
   * (their ranks are their own). */
  int32_t comm_rank;
  int32_t comm_world_size;
  const char* comm_store_addr;
  int32_t comm_store_port;
  /* STRATA_COMM_TCP and STRATA_COMM_NCCL (API 12): a stop request. While
   * strata_engine_create waits for the other ranks to meet and connect (up to
   * comm_timeout_s: minutes when a peer never comes; with NCCL, also NCCL's
   * own join, ncclCommInitRank or the split of nccl_comm), it reads *cancel
   * at least every 100 ms and, once it is nonzero, returns STRATA_ERR_CANCELLED
   * at once ("... interrupted (a stop signal) while waiting"), leaving
   * nothing behind. Set it from a signal handler (it may point at a volatile
   * sig_atomic_t) or from another thread while the call runs, e.g. so that
   * Ctrl-C ends a rank whose peers never came. It is only read. NULL: wait
   * until the timeout. Not read with STRATA_COMM_MPI (MPI's calls cannot be interrupted) or STRATA_COMM_NONE
   * (nothing waits). Borrowed for the call only. */
  const volatile int* cancel;
} strata_engine_options_t;

/* One parameter of the model. Zero-initialise, set struct_size and the rest. */
typedef struct strata_param_desc {
  size_t struct_size; /* sizeof(strata_param_desc_t); the same for every element of the array */
  const char* name;   /* unique, e.g. "model.layers.3.mlp.up_proj.weight"; borrowed for the call */
  const char* group;  /* unit of acquire/release, e.g. "layers.3"; borrowed for the call */
  uint32_t ndim;      /* 0..STRATA_MAX_DIMS; 0: a scalar (1 element) */
  uint64_t shape[STRATA_MAX_DIMS]; /* the first ndim entries, each >= 1 */
  strata_dtype_t dtype;            /* the compute dtype the device sees (0: F32) */
  /* Nonzero: frozen (PyTorch requires_grad=False; the base of a LoRA/PEFT
   * model): its compute copy is placed and streamed like any other, but it
   * has no fp32 master, no optimizer state and no gradient accumulator;
   * strata_engine_reduce_grad refuses it and the optimizer never writes it. */
  int32_t frozen;
  /* Nonzero: the optimizer uses weight decay 0 for it (Hugging Face
   * Trainer's convention for biases and norm weights). */
  int32_t no_weight_decay;
  /* Learning-rate group (a torch param_groups index); see
   * strata_engine_set_group_lr. 0 for a single group. */
  uint32_t lr_group;
} strata_param_desc_t;

/* What the engine knows about one parameter. The caller sets struct_size. */
typedef struct strata_param_info {
  size_t struct_size; /* sizeof(strata_param_info_t) */
  const char* name;   /* owned by the engine, valid until strata_engine_destroy */
  const char* group;  /* likewise */
  uint32_t group_id;
  uint32_t ndim;
  uint64_t shape[STRATA_MAX_DIMS]; /* entries past ndim are 0 */
  uint64_t numel;                  /* elements of the whole (unsharded) parameter */
  strata_dtype_t dtype;            /* compute dtype */
  int32_t frozen;                  /* as given in strata_param_desc_t */
  int32_t no_weight_decay;         /* likewise */
  uint32_t lr_group;               /* likewise */
} strata_param_info_t;

/* One group and where the planner put its state. The caller sets struct_size. */
typedef struct strata_group_info {
  size_t struct_size; /* sizeof(strata_group_info_t) */
  const char* name;   /* owned by the engine, valid until strata_engine_destroy */
  uint32_t param_count;
  uint64_t numel;                  /* elements of the whole group, all ranks */
  uint64_t gathered_compute_bytes; /* device bytes one acquire of it needs */
  strata_tier_t tier[4];           /* home tier, indexed by strata_state_kind_t */
} strata_group_info_t;

/* What one optimizer step did. The caller sets struct_size. */
typedef struct strata_step_result {
  size_t struct_size;      /* sizeof(strata_step_result_t) */
  int64_t step;            /* optimizer steps taken so far (skipped ones not counted) */
  int skipped;             /* nonzero: non-finite gradients, nothing was updated */
  uint32_t skipped_groups; /* overlap mode: groups left alone for non-finite gradients */
  double grad_norm;        /* global L2 norm of the averaged, unscaled gradients, before clipping */
  double clip_coef;        /* applied clipping coefficient (1: none) */
  double loss_scale;       /* the scale to use for the next micro-batches */
  double lr;               /* learning rate used */
  double seconds;          /* wall time of the step (overlap mode: of the part not hidden) */
} strata_step_result_t;

/* Counters since creation. The caller sets struct_size. */
typedef struct strata_engine_stats {
  size_t struct_size;     /* sizeof(strata_engine_stats_t) */
  uint64_t tier_bytes[4]; /* state bytes per tier (this rank), indexed by strata_tier_t */
  uint64_t device_buffer_bytes; /* device bytes held for gathered groups now */
  uint64_t pinned_bytes;        /* pinned pool bytes in use */
  uint64_t nvme_read_bytes, nvme_write_bytes;
  uint64_t h2d_bytes, d2h_bytes;
  uint64_t acquires, prefetch_hits, prefetch_misses, order_changes;
  uint64_t hot_path_allocs; /* allocations after the first step (should stay 0) */
  int64_t steps, skipped_steps;
  uint64_t comm_bytes; /* sent to the other ranks (API 5) */
  /* Stage 3: acquires whose all-gather was enqueued at an earlier group's
   * acquire, along the recorded order (API 7; not written for an API 6 struct). */
  uint64_t gathers_ahead;
  /* Stage 3: acquires that found their group still gathered in a device slot
   * and sent nothing (API 8; not written for a smaller struct). */
  uint64_t gathers_reused;
} strata_engine_stats_t;

/* Sets struct_size and the defaults (every other field 0: no config, auto
 * device, ordinal 0). STRATA_ERR_INVALID_ARGUMENT for NULL. Thread-safe. */
STRATA_API strata_status_t strata_engine_options_init(strata_engine_options_t* options);

/* Creates an engine for the model params[0..param_count): parses the config
 * (malformed JSON names the byte, line and column; an unknown or ill-typed
 * key names its path), plans the tiers, creates the device backend, I/O
 * engine and swap files, and allocates every tier's storage (zeroed: load
 * the initial values with strata_engine_load_param). Blocking (allocation
 * and file creation). Everything passed in is borrowed for the call only;
 * *engine is owned by the caller (strata_engine_destroy). The array's stride
 * is params[0].struct_size. Thread-safe (separate engines).
 * Errors (message in strata_last_error()): STRATA_ERR_INVALID_ARGUMENT (bad
 * options, struct_size, config or model: the message names the field, key or
 * parameter), STRATA_ERR_NOT_FOUND (config_path), STRATA_ERR_OUT_OF_BUDGET
 * (the plan cannot fit: says which tier is short and by how much),
 * STRATA_ERR_UNAVAILABLE (cuda asked and not usable; world_size > 1 with a
 * communicator this build or launch cannot make: strata_comm_kind_t), I/O and allocation errors naming what failed. */
STRATA_API strata_status_t strata_engine_create(const strata_engine_options_t* options,
                                                const strata_param_desc_t* params, size_t param_count,
                                                strata_engine_t* engine);

/* Waits for in-flight work, destroys the device streams of this engine that
 * are still alive (their handles stay the caller's but are dead: only
 * strata_stream_destroy, which then just frees the handle, may be called on
 * them), closes the trace and removes the swap files. Blocking. NULL is
 * fine. Not concurrently with any other call on the engine or its streams. */
STRATA_API void strata_engine_destroy(strata_engine_t engine);

/* The message of the last failed call on this engine or its streams ("" if
 * none): what failed, where and why. Owned by the engine; valid until the
 * next failing call on it, so read (or copy) it on the thread that made the
 * failed call, before its next call, or while no call on the engine is in
 * flight: a failing call on another thread frees it (strata_last_error() is
 * the calling thread's own copy). NULL engine: "". */
STRATA_API const char* strata_engine_last_error(strata_engine_t engine);

/* ---- the model (any thread; non-blocking) */

STRATA_API strata_status_t strata_engine_param_count(strata_engine_t engine, uint32_t* count);
STRATA_API strata_status_t strata_engine_group_count(strata_engine_t engine, uint32_t* count);
/* STRATA_ERR_NOT_FOUND when no parameter / group has that name. */
STRATA_API strata_status_t strata_engine_find_param(strata_engine_t engine, const char* name, uint32_t* param);
STRATA_API strata_status_t strata_engine_find_group(strata_engine_t engine, const char* name, uint32_t* group);
/* STRATA_ERR_INVALID_ARGUMENT for an id out of range or a bad struct_size. */
STRATA_API strata_status_t strata_engine_param_info(strata_engine_t engine, uint32_t param, strata_param_info_t* info);
STRATA_API strata_status_t strata_engine_group_info(strata_engine_t engine, uint32_t group, strata_group_info_t* info);
/* The ids of the group's parameters, in model order, into params[0..capacity);
 * *count receives how many there are. STRATA_ERR_INVALID_ARGUMENT (nothing
 * written) when capacity is smaller (the message says how many are needed). */
STRATA_API strata_status_t strata_engine_group_params(strata_engine_t engine, uint32_t group, uint32_t* params,
                                                      size_t capacity, size_t* count);
/* The backend the engine runs on and its name ("host", "cuda:0 (NVIDIA ...)").
 * *name is owned by the engine, valid until strata_engine_destroy. */
STRATA_API strata_status_t strata_engine_device(strata_engine_t engine, strata_device_kind_t* kind,
                                                const char** name);
/* This engine's rank and the number of ranks (rank 0 of 1 without a
 * communicator). */
STRATA_API strata_status_t strata_engine_ranks(strata_engine_t engine, uint32_t* rank, uint32_t* world_size);
/* The plan as multi-line text (tiers, groups, traffic per step); *text is
 * allocated for the caller: free with strata_free. */
STRATA_API strata_status_t strata_engine_plan_report(strata_engine_t engine, char** text);

/* ---- parameter values (driving thread; blocking) */

/* Sets parameter `param` from the whole (unsharded) tensor `src` (host
 * memory, `count` elements of `dtype`; count must be the parameter's numel):
 * it becomes the fp32 master and the compute copy (rounded to the compute
 * dtype). `src` is borrowed for the call. Errors: STRATA_ERR_INVALID_ARGUMENT
 * (id, dtype, count), I/O errors. */
STRATA_API strata_status_t strata_engine_load_param(strata_engine_t engine, uint32_t param, const void* src,
                                                    strata_dtype_t dtype, size_t count);
/* Copies the fp32 master of `param` to host memory `dst` as `count` (=
 * numel) elements of `dtype`: the whole tensor, on every rank (N ranks: a
 * collective, every rank must call it for the same parameter). */
STRATA_API strata_status_t strata_engine_read_param(strata_engine_t engine, uint32_t param, void* dst,
                                                    strata_dtype_t dtype, size_t count);
/* Copies rank `root`'s host bytes data[0, bytes) into every rank's data (API
 * 11): a collective over the engine's ranks (every rank calls it at the same
 * point with the same bytes and root). strata_engine_load_param keeps each
 * rank's own src, so ranks whose initial values may differ (a random init
 * without a common seed, a LoRA adapter's) broadcast each tensor from rank 0
 * before loading it, as DDP and DeepSpeed start every rank from rank 0's
 * values (strata.torch does). One rank: returns at once. Blocking. Errors:
 * STRATA_ERR_INVALID_ARGUMENT (root >= the world size, NULL data with bytes
 * > 0), the communicator's (a rank that ended, the timeout). */
STRATA_API strata_status_t strata_engine_broadcast(strata_engine_t engine, void* data, size_t bytes, uint32_t root);
/* The optimizer state of trainable `param` as `count` (= numel) fp32 values
 * (read: one rank only, STRATA_ERR_UNAVAILABLE with N ranks; load: each rank
 * takes its shard of the whole tensor):
 * state 0 is AdamW's exp_avg, 1 its exp_avg_sq (torch.optim.AdamW's state
 * names; the step count is strata_engine_step_count). read: to convert a
 * checkpoint to PyTorch or DeepSpeed; load: to convert one in (bf16 states
 * round to nearest even). Blocking. Errors: STRATA_ERR_INVALID_ARGUMENT (id,
 * count, a frozen parameter, a state the optimizer does not keep), I/O. */
STRATA_API strata_status_t strata_engine_read_state(strata_engine_t engine, uint32_t param, int state, float* dst,
                                                    size_t count);
STRATA_API strata_status_t strata_engine_load_state(strata_engine_t engine, uint32_t param, int state,
                                                    const float* src, size_t count);
/* Trainable `param`'s own count of optimizer steps that updated it: torch's
 * per-parameter state['step'], which its bias correction uses. Equal to
 * strata_engine_step_count unless no micro-batch reduced it in some steps
 * (then it was left alone and its count did not move). Saved in checkpoints.
 * set: when converting a torch or DeepSpeed state in, between steps, 0..the
 * engine's step count. Errors: STRATA_ERR_INVALID_ARGUMENT (id, frozen,
 * out of range, a micro-batch begun). */
STRATA_API strata_status_t strata_engine_param_steps(strata_engine_t engine, uint32_t param, int64_t* steps);
STRATA_API strata_status_t strata_engine_set_param_steps(strata_engine_t engine, uint32_t param, int64_t steps);

/* ---- the training protocol (driving thread) */

/* Marks the start of a micro-batch; nonzero `last` says it ends the gradient
 * accumulation. The step divides the summed gradients by the number of
 * micro-batches begun since the last step (strata.average_micro_batches, the
 * default; false: the caller scaled them). Non-blocking.
 * STRATA_ERR_INVALID_ARGUMENT while groups are still acquired, and with
 * strata.overlap_backward after a `last` micro-batch until the step (or
 * discard_step): the optimizer is already updating what that one reduced. */
STRATA_API strata_status_t strata_engine_begin_micro_batch(strata_engine_t engine, int last);

/* Makes the group's parameters available on the device and `stream` wait for
 * them. ptrs[0..capacity) receives one device pointer per parameter of the
 * group (the whole parameter in its compute dtype, in model order, as
 * strata_engine_group_params lists them), *count how many. The pointers are
 * owned by the engine and valid until the group's last hold is released.
 * Holds are counted: acquiring a group already held (a tied weight, a nested
 * module, a backward hook while the forward still holds it) adds a hold and
 * returns the same pointers, on any stream (each waits for the upload). Up to
 * "strata.held_groups" distinct groups (default 1) may be held at once
 * beyond what prefetch buffers happen to allow; "strata.debug_poison_released"
 * fills a gathered group's buffer with NaN bytes at its last release, so a
 * view used after release shows up as NaN. Blocks only when the upload needs
 * a staging buffer still in use (back-pressure). Errors:
 * STRATA_ERR_INVALID_ARGUMENT (group id, 65536 holds without a release,
 * capacity too small: nothing acquired), STRATA_ERR_OUT_OF_BUDGET (the group
 * does not fit the device buffers: says by how much; every device buffer
 * held), I/O errors of the upload. */
STRATA_API strata_status_t strata_engine_acquire(strata_engine_t engine, uint32_t group, strata_stream_t stream,
                                                 void** ptrs, size_t capacity, size_t* count);
/* Drops one hold of the group; at the last, its buffers are reused once every
 * stream that released it passed its release (a release on another stream
 * than the previous one makes it wait for that point). Non-blocking.
 * STRATA_ERR_INVALID_ARGUMENT if not acquired. */
STRATA_API strata_status_t strata_engine_release(strata_engine_t engine, uint32_t group, strata_stream_t stream);
/* Accumulates the gradient of `param` (a buffer of numel elements of
 * `dtype`: F32, BF16 or F16) into its fp32 gradient shard, once `stream`
 * reaches this point. The buffer: device memory on CUDA; on the host
 * backend any host memory (the caller's own, e.g. a torch CPU tensor's
 * data_ptr()). Asynchronous: the buffer may be reused by work enqueued on
 * `stream` after the call (`stream` waits until it was read: with
 * strata.gradient_staging, the default on CUDA and with N ranks, a device
 * copy only, not the download to host nor the N-rank reduce-scatter). A failed call changes nothing and may be retried
 * (no buffer is leaked, nothing waits forever), unless its message says part
 * of the gradient was accumulated: then strata_engine_step refuses until
 * strata_engine_discard_step. Errors: STRATA_ERR_INVALID_ARGUMENT (id, dtype,
 * reduced twice in one micro-batch, a frozen parameter). */
STRATA_API strata_status_t strata_engine_reduce_grad(strata_engine_t engine, uint32_t param, const void* grad,
                                                     strata_dtype_t dtype, strata_stream_t stream);
/* Abandons the step in progress (an exception in the caller's forward or
 * backward, a torn reduce_grad): releases every acquired group on `stream`
 * (may be NULL when none is acquired), waits for the gradient work in flight
 * and forgets every gradient of this step, all its micro-batches; weights and
 * optimizer state stay as after the last step. Blocking. Errors:
 * STRATA_ERR_INVALID_ARGUMENT when overlap_backward already updated a group
 * of this step (the weights moved: load a checkpoint). */
STRATA_API strata_status_t strata_engine_discard_step(strata_engine_t engine, strata_stream_t stream);

/* ---- DLPack (driving thread)
 *
 * The tensor exchange of PyTorch (torch.from_dlpack / torch.utils.dlpack),
 * JAX, CuPy: DLManagedTensor as dlpack.h (DLPack 0.6 and later, the
 * unversioned struct) defines it. This header only names the struct; include
 * dlpack.h to read it. */
struct DLManagedTensor;

/* A view of trainable or frozen `param` in its held group's device buffer, as
 * a DLManagedTensor the caller owns: device kDLCPU (host backend) or kDLCUDA
 * with the engine's device, the compute dtype (kDLFloat 32 / kDLBfloat 16 /
 * kDLFloat 16), the parameter's shape, compact row-major strides. No copy:
 * the memory is the pointer strata_engine_acquire gives, valid until the
 * group's last hold is released (a consumer's tensor must not be used after
 * that; "strata.debug_poison_released" makes such use show as NaN). Call its
 * deleter (any thread, once) to free the struct; that releases nothing.
 * Errors: STRATA_ERR_INVALID_ARGUMENT (id, the group is not held). */
STRATA_API strata_status_t strata_engine_param_dlpack(strata_engine_t engine, uint32_t param,
                                                      struct DLManagedTensor** out);
/* strata_engine_reduce_grad with the gradient as a DLPack tensor, whose
 * ownership passes to the engine on success: it calls grad->deleter (on the
 * driving thread, inside a later strata_engine_* call: reduce_grad_dlpack,
 * begin_micro_batch, step, discard_step, or destroy) once the engine's read
 * of it is done, so the caller need not keep the gradient alive nor wait for
 * the stream (torch: torch.utils.dlpack.to_dlpack(grad)). On failure the
 * caller still owns it. Checked: the device (kDLCPU or kDLCUDAHost on the
 * host backend; kDLCUDA on the engine's device on CUDA), dtype (float32,
 * bfloat16, float16, one lane), shape equal to the parameter's, compact
 * row-major strides (NULL or equal to them); each refusal names the field.
 * Errors: as strata_engine_reduce_grad, plus those checks. */
STRATA_API strata_status_t strata_engine_reduce_grad_dlpack(strata_engine_t engine, uint32_t param,
                                                            struct DLManagedTensor* grad, strata_stream_t stream);
/* One optimizer step: global gradient norm, fp16 loss scaling (overflow:
 * skipped, scale lowered), clipping, then the optimizer over every shard of
 * every parameter a micro-batch of this step reduced (the others are left
 * alone: no update, no weight decay, as torch skips a grad of None).
 * lr < 0 keeps the current lr: the last lr >= 0 given to a step, at first
 * the config's optimizer.lr; a NaN or infinite lr is refused before the step
 * runs. Learning-rate groups with their own lr
 * (strata_engine_set_group_lr) use theirs. Blocks until the step is decided
 * (pipelined, the default: the updates finish in the background, see
 * strata_engine_synchronize; else until done). result may be NULL; else its
 * struct_size is checked before the step runs. Errors: the first error of
 * the step's asynchronous work (I/O: naming tensor and chunk),
 * STRATA_ERR_INVALID_ARGUMENT (groups still acquired). After an error the
 * engine refuses further steps until a checkpoint is loaded. */
STRATA_API strata_status_t strata_engine_step(strata_engine_t engine, double lr, strata_step_result_t* result);
/* Blocks until the engine's background work is done and returns its first
 * error. With strata.pipelined_step (the default; docs/engine.md),
 * strata_engine_step returns once the step is decided (norm, skip, loss
 * scale, clipping: the result is final) and the groups' updates are applied
 * behind the next forward; a failure of one (an NVMe error) is reported by
 * the next call that meets it, or here. Call it before exiting when the last
 * step's outcome matters without a save. After such an error the engine
 * refuses steps and saves until a checkpoint is loaded. (API version 6.) */
STRATA_API strata_status_t strata_engine_synchronize(strata_engine_t engine);
/* Gives every parameter with this lr_group (strata_param_desc_t) its own
 * learning rate from the next update on: what a torch scheduler sets per
 * param_group. lr < 0: the group follows the lr given to strata_engine_step
 * again. With overlap_backward, set it before the last micro-batch begins.
 * Not saved in checkpoints (the scheduler sets it every step). Errors:
 * STRATA_ERR_INVALID_ARGUMENT (no trainable parameter has that lr_group,
 * lr not finite). */
STRATA_API strata_status_t strata_engine_set_group_lr(strata_engine_t engine, uint32_t lr_group, double lr);
/* Gives every parameter with this lr_group its own Adam/AdamW betas from the
 * next update on (< 0: the config's optimizer.params.betas): what a torch
 * scheduler cycling momentum (DeepSpeed's OneCycle) sets per param_group.
 * With overlap_backward, set them before the last micro-batch begins. Not
 * saved in checkpoints. Errors: STRATA_ERR_INVALID_ARGUMENT (no trainable
 * parameter has that lr_group, a beta >= 1 or not finite, an optimizer
 * without betas). */
STRATA_API strata_status_t strata_engine_set_group_betas(strata_engine_t engine, uint32_t lr_group, double beta1,
                                                         double beta2);
/* Sets the learning rate of every group without its own (what a torch
 * scheduler sets each step): the next update uses it; with overlap_backward,
 * set it before the last micro-batch begins (strata_engine_step's lr applies
 * from the step after). Errors: STRATA_ERR_INVALID_ARGUMENT (not finite or < 0). */
STRATA_API strata_status_t strata_engine_set_lr(strata_engine_t engine, double lr);
/* The loss scale for the next micro-batch (fp16 dynamic scaling; 1
 * otherwise): multiply the loss by it before backward. Non-blocking. */
STRATA_API strata_status_t strata_engine_loss_scale(strata_engine_t engine, double* scale);
/* Optimizer steps taken (skipped ones not counted). */
STRATA_API strata_status_t strata_engine_step_count(strata_engine_t engine, int64_t* steps);

/* ---- checkpoints (driving thread, between steps; blocking) */

/* Saves the full training state (compute copies, masters, optimizer states,
 * step, loss-scale state) and `extra_json` (the caller's state such as the
 * data position; any JSON text, NULL: none) to directory `dir`, atomically
 * (staging directory, fsync, rename). NVMe-resident state is streamed file
 * to file. Errors: I/O errors naming the file, STRATA_ERR_NO_SPACE. */
STRATA_API strata_status_t strata_engine_save_checkpoint(strata_engine_t engine, const char* dir,
                                                         const char* extra_json);
/* Verifies every checksum, then restores the state saved in `dir`; the
 * model (names, shapes, dtypes) must match. *extra_json (when not NULL)
 * receives the caller's saved state as a NUL-terminated string allocated for
 * the caller ("" if none was saved): free with strata_free. Errors:
 * STRATA_ERR_CORRUPT naming the damaged file, STRATA_ERR_INVALID_ARGUMENT on
 * a model mismatch (naming the parameter), STRATA_ERR_NOT_FOUND. */
STRATA_API strata_status_t strata_engine_load_checkpoint(strata_engine_t engine, const char* dir,
                                                         char** extra_json);

/* ---- observability (any thread; non-blocking) */

STRATA_API strata_status_t strata_engine_stats(strata_engine_t engine, strata_engine_stats_t* stats);
/* A caller compute span named `name` (copied) on the trace, category
 * "compute"; nothing happens when the config has no "strata.trace". Spans
 * nest; trace_end closes the innermost. */
STRATA_API strata_status_t strata_engine_trace_begin(strata_engine_t engine, const char* name);
STRATA_API strata_status_t strata_engine_trace_end(strata_engine_t engine);

/* ------------------------------------------------------------------ streams and device memory
 * Any thread. A stream belongs to the engine it was made with and is used
 * with that engine only. Destroy streams before their engine; a handle
 * outliving its engine is dead (see strata_engine_destroy). */

/* A new stream on the engine's device (cuda: a non-blocking CUDA stream;
 * host: a worker thread). `name` (copied; NULL: "stream") appears in
 * messages and traces. *stream is owned by the caller. */
STRATA_API strata_status_t strata_stream_create(strata_engine_t engine, const char* name, strata_stream_t* stream);
/* Wraps the caller's native stream (a cudaStream_t, e.g. PyTorch's
 * torch.cuda.current_stream().cuda_stream; NULL is CUDA's legacy default
 * stream) so the engine orders its work against it. The native stream stays
 * the caller's: keep it alive until strata_stream_destroy of the wrapper,
 * which does not destroy it. It must belong to the engine's device.
 * STRATA_ERR_INVALID_ARGUMENT on the host backend (no native streams). */
STRATA_API strata_status_t strata_stream_wrap(strata_engine_t engine, void* native, strata_stream_t* stream);
/* Blocks until the work enqueued on the stream so far is done, then frees
 * it (a wrapped native stream itself is left alive). Returns the stream's
 * pending asynchronous error, if any (the stream is freed either way). NULL
 * is fine. */
STRATA_API strata_status_t strata_stream_destroy(strata_stream_t stream);
/* Blocks until the work enqueued so far is done; returns the stream's first
 * asynchronous error (sticky). */
STRATA_API strata_status_t strata_stream_synchronize(strata_stream_t stream);

/* Events: a point in a stream's work, on either backend (cuda: a CUDA event
 * without timing; host: a marker on the stream's worker thread), so a
 * trainer can order its work against the engine's without blocking: record
 * after an acquire on the engine's stream and make its own wait, or poll.
 * Any thread. An event belongs to the engine it was made with; destroy it
 * before the engine (a handle outliving its engine is dead, as a stream's).
 * An event never recorded is complete. */
STRATA_API strata_status_t strata_event_create(strata_engine_t engine, strata_event_t* event);
STRATA_API strata_status_t strata_event_destroy(strata_event_t event); /* NULL is fine */
/* Captures the work enqueued on `stream` so far (re-recording moves it). */
STRATA_API strata_status_t strata_event_record(strata_event_t event, strata_stream_t stream);
/* Work enqueued on `stream` after this call waits for the event's last
 * record (never the host). */
STRATA_API strata_status_t strata_stream_wait_event(strata_stream_t stream, strata_event_t event);
/* *done = 1 when the recorded work is complete, else 0. Non-blocking. */
STRATA_API strata_status_t strata_event_query(strata_event_t event, int* done);
/* Blocks until the recorded work is complete. */
STRATA_API strata_status_t strata_event_synchronize(strata_event_t event);

/* Device memory from the engine's device pool (under its budget, shared
 * with the engine's buffers): e.g. gradient buffers on the host backend,
 * where the engine reads only memory of its device. 256-byte aligned,
 * contents undefined. STRATA_ERR_OUT_OF_BUDGET when the budget cannot hold it. */
STRATA_API strata_status_t strata_device_alloc(strata_engine_t engine, size_t bytes, void** ptr);
/* Returns a block from strata_device_alloc. `after` NULL: no enqueued work
 * uses it any more; else it is reused once `after` passes this point.
 * Non-blocking. NULL ptr is fine. */
STRATA_API strata_status_t strata_device_free(strata_engine_t engine, void* ptr, strata_stream_t after);
/* Enqueues a copy of `bytes` on `stream`; returns once enqueued. The host
 * side must stay valid (and unchanged, for host to device) until the stream
 * passes this point. Errors while it runs come from strata_stream_synchronize. */
STRATA_API strata_status_t strata_memcpy_async(void* dst, const void* src, size_t bytes, strata_copy_kind_t kind,
                                               strata_stream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_STRATA_H_ */
