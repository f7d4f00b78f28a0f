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

#define STRATA_API_VERSION 1

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
 * many threads (0: the cores this process may use, or STRATA_THREADS).
 * Returns STRATA_ERR_UNAVAILABLE when `isa` cannot run on this CPU. The handle
 * is owned by the caller (strata_cpu_optimizer_destroy). A handle may be used
 * from one thread at a time; separate handles are independent. */
STRATA_API strata_status_t strata_cpu_optimizer_create(strata_isa_t isa, int threads, strata_cpu_optimizer_t* out);

/* Frees the handle (NULL is fine). */
STRATA_API void strata_cpu_optimizer_destroy(strata_cpu_optimizer_t opt);

/* One optimizer step over `count` elements; `step` is 1 on the first call
 * (PyTorch's state['step'] after increment). Synchronous: it returns when all
 * buffers are updated. Nothing is modified when it fails:
 * STRATA_ERR_INVALID_ARGUMENT for missing buffers, bad dtypes, step < 1 or
 * hyper-parameters PyTorch would reject. */
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

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_STRATA_H_ */
