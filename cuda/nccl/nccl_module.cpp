// libstrata_nccl.so: NCCL for the communicator (src/comm/nccl_comm.cpp),
// loaded with dlopen. Exports only strata_nccl_api_v2. Plain C++ over the
// CUDA runtime and NCCL: no kernels (the rank-order sums run on the device
// backend's accumulate kernel).
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "cuda/nccl/nccl_module_abi.h"

static_assert(NCCL_UNIQUE_ID_BYTES == STRATA_NCCL_UNIQUE_ID_BYTES, "unique id size");
static_assert(sizeof(ncclUniqueId) == STRATA_NCCL_UNIQUE_ID_BYTES, "unique id size");
static_assert(static_cast<int>(ncclInProgress) == 7, "ncclInProgress (the ABI says 7)");

namespace {

using Clock = std::chrono::steady_clock;

int cuda_fail(cudaError_t e, const char* what, char* err, size_t err_len) {
  if (err && err_len) std::snprintf(err, err_len, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  return static_cast<int>(e);
}

int nccl_fail(ncclResult_t r, ncclComm_t comm, const char* what, char* err, size_t err_len) {
  const char* last = ncclGetLastError(comm);
  if (err && err_len)
    std::snprintf(err, err_len, "%s: %s%s%s", what, ncclGetErrorString(r), last && last[0] ? ": " : "",
                  last ? last : "");
  return STRATA_NCCL_ERR_BASE + static_cast<int>(r);
}

#define CUDA_TRY(expr)                                               \
  do {                                                               \
    cudaError_t _e = (expr);                                         \
    if (_e != cudaSuccess) return cuda_fail(_e, #expr, err, err_len); \
  } while (0)

// A non-blocking communicator answers ncclInProgress while it finishes the
// host side of a call on its own thread; poll until it is done (NCCL's rule:
// no other call on the communicator before that). That host side can wait on
// peers (connections are set up lazily, at the first transfer to a peer and
// the first use of an algorithm), so the poll has a deadline: past it the
// caller gets STRATA_NCCL_ERR_TIMEOUT and must abort the communicator.
// Polling backs off from yields to 50 us sleeps.
int settle(ncclComm_t comm, ncclResult_t r, double timeout_s, const char* what, char* err, size_t err_len) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  for (int spins = 0; r == ncclInProgress; ++spins) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q != ncclSuccess) return nccl_fail(q, comm, "ncclCommGetAsyncError", err, err_len);
    r = state;
    if (r != ncclInProgress) break;
    if (Clock::now() > deadline) {
      if (err && err_len)
        std::snprintf(err, err_len, "%s: NCCL still setting it up after %.0f s (a peer that died, hangs or called "
                      "another collective)", what, timeout_s);
      return STRATA_NCCL_ERR_TIMEOUT;
    }
    if (spins < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return r == ncclSuccess ? 0 : nccl_fail(r, comm, what, err, err_len);
}

#define NCCL_TRY(comm, expr)                                                   \
  do {                                                                         \
    const int _rc = settle(comm, (expr), timeout_s, #expr, err, err_len);      \
    if (_rc != 0) return _rc;                                                  \
  } while (0)

// Polls the communicator's state until it leaves ncclInProgress, the
// deadline passes or the caller asks to stop (0: ready, else an error code).
int wait_ready(ncclComm_t comm, double timeout_s, const strata_nccl_stop_t* stop, const char* what, char* err,
               size_t err_len) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    if (stop && stop->requested && stop->requested(stop->ctx) != 0) {
      if (err && err_len) std::snprintf(err, err_len, "%s: interrupted (a stop signal) while waiting", what);
      return STRATA_NCCL_ERR_CANCELLED;
    }
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q != ncclSuccess) return nccl_fail(q, comm, "ncclCommGetAsyncError", err, err_len);
    if (state == ncclSuccess) return 0;
    if (state != ncclInProgress) return nccl_fail(state, comm, what, err, err_len);
    if (Clock::now() > deadline) {
      if (err && err_len) std::snprintf(err, err_len, "%s: not done after %.0f s", what, timeout_s);
      return STRATA_NCCL_ERR_TIMEOUT;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

int version(int* out, char* err, size_t err_len) {
  const ncclResult_t r = ncclGetVersion(out);
  if (r != ncclSuccess) return nccl_fail(r, nullptr, "ncclGetVersion", err, err_len);
  return 0;
}

int unique_id(uint8_t* id, char* err, size_t err_len) {
  ncclUniqueId u;
  const ncclResult_t r = ncclGetUniqueId(&u);
  if (r != ncclSuccess) return nccl_fail(r, nullptr, "ncclGetUniqueId", err, err_len);
  std::memcpy(id, u.internal, sizeof(u.internal));
  return 0;
}

int comm_init(int device, const uint8_t* id, int world, int rank, double timeout_s, const strata_nccl_stop_t* stop,
              void** out, char* err, size_t err_len) {
  *out = nullptr;
  CUDA_TRY(cudaSetDevice(device));
  ncclUniqueId u;
  std::memcpy(u.internal, id, sizeof(u.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, world, u, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm) ncclCommAbort(comm);
    return nccl_fail(r, nullptr, "ncclCommInitRankConfig", err, err_len);
  }
  const int rc =
      wait_ready(comm, timeout_s, stop, "ncclCommInitRankConfig (waiting for every rank to join)", err, err_len);
  if (rc != 0) {
    ncclCommAbort(comm);
    return rc;
  }
  *out = comm;
  return 0;
}

int comm_split(int device, void* parent, double timeout_s, const strata_nccl_stop_t* stop, void** out, int* world,
               int* rank, char* err, size_t err_len) {
  *out = nullptr;
  CUDA_TRY(cudaSetDevice(device));
  auto p = static_cast<ncclComm_t>(parent);
  int parent_device = -1, parent_rank = -1;
  ncclResult_t r = ncclCommCuDevice(p, &parent_device);
  if (r != ncclSuccess) return nccl_fail(r, p, "ncclCommCuDevice (of the caller's communicator)", err, err_len);
  if (parent_device != device) {
    if (err && err_len)
      std::snprintf(err, err_len, "the caller's NCCL communicator is on GPU %d, the engine's device is GPU %d",
                    parent_device, device);
    return STRATA_NCCL_ERR_BASE + ncclInvalidArgument;
  }
  r = ncclCommUserRank(p, &parent_rank);
  if (r != ncclSuccess) return nccl_fail(r, p, "ncclCommUserRank (of the caller's communicator)", err, err_len);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  r = ncclCommSplit(p, 0, parent_rank, &comm, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm) ncclCommAbort(comm);
    return nccl_fail(r, p, "ncclCommSplit (of the caller's communicator)", err, err_len);
  }
  if (comm == nullptr) {
    if (err && err_len) std::snprintf(err, err_len, "ncclCommSplit gave no communicator");
    return STRATA_NCCL_ERR_BASE + ncclInternalError;
  }
  int rc = wait_ready(comm, timeout_s, stop, "ncclCommSplit (waiting for every rank of the caller's communicator)", err,
                      err_len);
  if (rc == 0 && (r = ncclCommCount(comm, world)) != ncclSuccess) rc = nccl_fail(r, comm, "ncclCommCount", err, err_len);
  if (rc == 0 && (r = ncclCommUserRank(comm, rank)) != ncclSuccess)
    rc = nccl_fail(r, comm, "ncclCommUserRank", err, err_len);
  if (rc != 0) {
    ncclCommAbort(comm);
    return rc;
  }
  *out = comm;
  return 0;
}

int comm_finalize_destroy(int device, void* c, double timeout_s, char* err, size_t err_len) {
  CUDA_TRY(cudaSetDevice(device));
  auto comm = static_cast<ncclComm_t>(c);
  ncclResult_t r = ncclCommFinalize(comm);
  int rc = 0;
  if (r != ncclSuccess && r != ncclInProgress)
    rc = nccl_fail(r, comm, "ncclCommFinalize", err, err_len);
  else
    rc = wait_ready(comm, timeout_s, nullptr, "ncclCommFinalize (flushing the last operations)", err, err_len);
  if (rc != 0) {
    ncclCommAbort(comm);
    return rc;
  }
  r = ncclCommDestroy(comm);
  if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(r, nullptr, "ncclCommDestroy", err, err_len);
  return 0;
}

int comm_abort(int device, void* c, char* err, size_t err_len) {
  CUDA_TRY(cudaSetDevice(device));
  const ncclResult_t r = ncclCommAbort(static_cast<ncclComm_t>(c));
  if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(r, nullptr, "ncclCommAbort", err, err_len);
  return 0;
}

int comm_async_error(void* c, int* state, char* err, size_t err_len) {
  auto comm = static_cast<ncclComm_t>(c);
  ncclResult_t s = ncclSuccess;
  const ncclResult_t q = ncclCommGetAsyncError(comm, &s);
  if (q != ncclSuccess) return nccl_fail(q, comm, "ncclCommGetAsyncError", err, err_len);
  *state = static_cast<int>(s);
  if (s != ncclSuccess && s != ncclInProgress) nccl_fail(s, comm, "NCCL operation", err, err_len);
  return 0;
}

int all_gather(int device, void* c, const void* send, void* recv, size_t bytes_per_rank, void* stream,
               double timeout_s, char* err, size_t err_len) {
  CUDA_TRY(cudaSetDevice(device));
  auto comm = static_cast<ncclComm_t>(c);
  NCCL_TRY(comm, ncclAllGather(send, recv, bytes_per_rank, ncclUint8, comm, static_cast<cudaStream_t>(stream)));
  return 0;
}

int exchange(int device, void* c, const strata_nccl_xfer_t* xfers, int count, void* stream, double timeout_s,
             char* err, size_t err_len) {
  CUDA_TRY(cudaSetDevice(device));
  auto comm = static_cast<ncclComm_t>(c);
  auto s = static_cast<cudaStream_t>(stream);
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) return nccl_fail(r, comm, "ncclGroupStart", err, err_len);
  // A non-blocking communicator may answer a call inside a group with
  // ncclInProgress: that is no failure, and every operation must still be
  // posted (a group closed short of what the peers posted hangs them).
  auto ok = [](ncclResult_t v) { return v == ncclSuccess || v == ncclInProgress; };
  ncclResult_t first = ncclSuccess;
  for (int i = 0; i < count && ok(first); ++i) {
    const strata_nccl_xfer_t& x = xfers[i];
    if (x.send_bytes) first = ncclSend(x.send, x.send_bytes, ncclUint8, x.peer, comm, s);
    if (ok(first) && x.recv_bytes) first = ncclRecv(x.recv, x.recv_bytes, ncclUint8, x.peer, comm, s);
  }
  // The group is always closed (an open group would swallow later calls).
  const int end = settle(comm, ncclGroupEnd(), timeout_s, "ncclGroupEnd of ncclSend/ncclRecv", err, err_len);
  if (first != ncclSuccess && first != ncclInProgress)
    return nccl_fail(first, comm, "ncclSend/ncclRecv in a group", err, err_len);
  return end;
}

int broadcast(int device, void* c, void* data, size_t bytes, int root, void* stream, double timeout_s, char* err,
              size_t err_len) {
  CUDA_TRY(cudaSetDevice(device));
  auto comm = static_cast<ncclComm_t>(c);
  NCCL_TRY(comm, ncclBroadcast(data, data, bytes, ncclUint8, root, comm, static_cast<cudaStream_t>(stream)));
  return 0;
}

int all_reduce_unordered(int device, void* c, const float* send, float* recv, size_t count, void* stream,
                         double timeout_s, char* err, size_t err_len) {
  CUDA_TRY(cudaSetDevice(device));
  auto comm = static_cast<ncclComm_t>(c);
  NCCL_TRY(comm, ncclAllReduce(send, recv, count, ncclFloat32, ncclSum, comm, static_cast<cudaStream_t>(stream)));
  return 0;
}

const strata_nccl_api_v2_t kApi = {
    sizeof(strata_nccl_api_v2_t),
    STRATA_NCCL_ABI_VERSION,
    version,
    unique_id,
    comm_init,
    comm_finalize_destroy,
    comm_abort,
    comm_async_error,
    all_gather,
    exchange,
    broadcast,
    all_reduce_unordered,
    comm_split,
};

}  // namespace

extern "C" __attribute__((visibility("default"))) const strata_nccl_api_v2_t* strata_nccl_api_v2(void) {
  return &kApi;
}
