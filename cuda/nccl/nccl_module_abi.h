// The ABI between the NCCL communicator (src/comm/nccl_comm.cpp) and the NCCL
// module libstrata_nccl.so (cuda/nccl/).
//
// Why a third module: libnccl is large and often installed apart from the
// CUDA runtime (a pip wheel, a distribution package); the device backend and
// the model ops must load on machines without it. Only a job that asks for
// the NCCL communicator loads this module, and a missing libnccl is reported
// to it alone, with dlopen's text.
//
// Like cuda/module_abi.h: the module exports one C symbol,
// strata_nccl_api_v2, returning a table of plain C function pointers that
// starts with its size and ABI version; a loader reads only fields within
// struct_size. Every function returns 0 on success or a nonzero code: a
// cudaError_t value (below STRATA_CUDA_ERR_BLAS_BASE), or
// STRATA_NCCL_ERR_BASE + an ncclResult_t, or STRATA_NCCL_ERR_TIMEOUT; the text
// goes to err (NUL-terminated, truncated to err_len).
//
// Communicators are created non-blocking (ncclConfig_t.blocking = 0): a call
// that NCCL answers with ncclInProgress is polled here until it is done or
// failed. NCCL's host side of a call can wait on peers (connections are set
// up lazily), so every call takes `timeout_s` and returns
// STRATA_NCCL_ERR_TIMEOUT past it; the caller must then abort the
// communicator. Every call makes `device` current on the calling thread
// first. Collectives only enqueue on `stream` (a cudaStream_t); what goes
// wrong while they run shows in comm_async_error, and comm_abort ends them.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "cuda/module_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

#define STRATA_NCCL_ABI_VERSION 2u  // 2: comm_init and comm_split take a stop request

#define STRATA_NCCL_ERR_BASE 2000                   // + ncclResult_t
#define STRATA_NCCL_ERR_TIMEOUT 2999                // a call ran out of its timeout_s
#define STRATA_NCCL_ERR_CANCELLED 2998              // the caller's stop request ended the wait
#define STRATA_NCCL_UNIQUE_ID_BYTES 128             // NCCL_UNIQUE_ID_BYTES

// One peer's part of an exchange: `send_bytes` from `send` to `peer`, and
// `recv_bytes` from `peer` into `recv` (either may be 0: nothing posted; the
// peer's matching entry must say the same). peer may be this rank.
typedef struct strata_nccl_xfer_s {
  int peer;
  int reserved;
  const void* send;
  size_t send_bytes;
  void* recv;
  size_t recv_bytes;
} strata_nccl_xfer_t;

// The caller's stop request, polled while a communicator is made (every
// millisecond, on the calling thread): requested(ctx) != 0 ends the wait, the
// communicator is aborted and the call returns STRATA_NCCL_ERR_CANCELLED. A
// null pointer or null `requested`: waits up to the timeout.
typedef struct strata_nccl_stop_s {
  int (*requested)(void* ctx);
  void* ctx;
} strata_nccl_stop_t;

typedef struct strata_nccl_api_v2_s {
  uint32_t struct_size;
  uint32_t abi_version;

  // ncclGetVersion (e.g. 22809 for 2.28.9).
  int (*version)(int* out, char* err, size_t err_len);
  // ncclGetUniqueId into id[STRATA_NCCL_UNIQUE_ID_BYTES] (rank 0 makes it).
  int (*unique_id)(uint8_t* id, char* err, size_t err_len);
  // ncclCommInitRankConfig (non-blocking) on `device`, then polls until the
  // communicator is ready, failed, `timeout_s` passed (then aborted:
  // STRATA_NCCL_ERR_TIMEOUT) or `stop` was requested (aborted:
  // STRATA_NCCL_ERR_CANCELLED).
  int (*comm_init)(int device, const uint8_t* id, int world, int rank, double timeout_s, const strata_nccl_stop_t* stop,
                   void** comm, char* err, size_t err_len);
  // ncclCommFinalize, polled up to timeout_s, then ncclCommDestroy; on failure
  // or timeout the communicator is aborted instead (and the code returned).
  int (*comm_finalize_destroy)(int device, void* comm, double timeout_s, char* err, size_t err_len);
  // ncclCommAbort: uncompleted operations end; the handle is gone. Any thread.
  int (*comm_abort)(int device, void* comm, char* err, size_t err_len);
  // ncclCommGetAsyncError: *state is the ncclResult_t (0 ncclSuccess,
  // 7 ncclInProgress, else the error; err gets ncclGetLastError's text).
  int (*comm_async_error)(void* comm, int* state, char* err, size_t err_len);

  // ---- collectives (enqueue on stream)
  // ncclAllGather of bytes_per_rank bytes (ncclUint8); in place when send ==
  // recv + rank * bytes_per_rank.
  int (*all_gather)(int device, void* comm, const void* send, void* recv, size_t bytes_per_rank, void* stream,
                    double timeout_s, char* err, size_t err_len);
  // One NCCL group of ncclSend/ncclRecv, one pair per entry.
  int (*exchange)(int device, void* comm, const strata_nccl_xfer_t* xfers, int count, void* stream, double timeout_s,
                  char* err, size_t err_len);
  // ncclBroadcast in place (ncclUint8).
  int (*broadcast)(int device, void* comm, void* data, size_t bytes, int root, void* stream, double timeout_s,
                   char* err, size_t err_len);
  // ncclAllReduce of `count` floats (ncclSum; NCCL's order: for barriers and
  // flags, never for results that must be deterministic).
  int (*all_reduce_unordered)(int device, void* comm, const float* send, float* recv, size_t count, void* stream,
                              double timeout_s, char* err, size_t err_len);

  // ---- appended (a loader checks struct_size before using them)
  // A child of the caller's communicator `parent` (ncclCommSplit, color 0,
  // key = the parent's rank; non-blocking, polled like comm_init, `stop`
  // too), after
  // checking that the parent's GPU is `device`; its rank and size in *rank
  // and *world. Collective over the parent's ranks. The parent is untouched
  // (an abort of the child leaves it working).
  int (*comm_split)(int device, void* parent, double timeout_s, const strata_nccl_stop_t* stop, void** comm, int* world,
                    int* rank, char* err, size_t err_len);
} strata_nccl_api_v2_t;

typedef const strata_nccl_api_v2_t* (*strata_nccl_api_v2_fn)(void);
#define STRATA_NCCL_API_SYMBOL "strata_nccl_api_v2"

#ifdef __cplusplus
}
#endif
