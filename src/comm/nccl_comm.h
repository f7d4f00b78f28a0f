// NcclCommunicator: the Communicator over NCCL, for CUDA-backend buffers.
// NCCL itself lives in a module loaded at run time (libstrata_nccl.so,
// cuda/nccl/nccl_module_abi.h), next to libstrata_cuda.so; a build without
// NCCL, or a machine where the module or libnccl does not load, gets
// kUnavailable with dlopen's text.
//
// How it runs. The communicator owns one stream of its own (the "comm
// stream") on the backend's GPU. Each collective makes the comm stream wait
// for the caller's stream, runs there, and makes the caller's stream wait for
// it: communication overlaps whatever else the device does, and collectives
// run one after another in the order they were called (one NCCL
// communicator, one stream: no two NCCL kernels of it ever wait on each
// other). Calls are serialized by a lock, so calls from several threads get
// one order; every rank must call in the same order (communicator.h).
//
// Determinism (communicator.h's fixed order, the same bits as the MPI and
// self backends): reduce_scatter and all_reduce never use NCCL's reductions.
// They move each rank's slice to its owner with one group of
// ncclSend/ncclRecv into a scratch buffer (world x chunk floats, allocated
// once from the backend's pool; larger calls run in chunks), then sum on the
// comm stream with the device backend's kernels: out = in_0 (a copy), out +=
// in_1, ... in rank order (the accumulate kernel, fp32 adds, no FMA). all_gather
// and broadcast move bytes (ncclAllGather, ncclBroadcast); barrier is a
// one-float ncclAllReduce.
//
// Failure. A watchdog thread follows every collective (events recorded on
// the comm stream before and after it). One that has not completed
// `timeout_s` after it could start (the caller's work before it and the
// collectives before it done), or an asynchronous NCCL error (a peer that
// died: ncclRemoteError/ncclSystemError), aborts the NCCL communicator
// (ncclCommAbort, outside the lock: its kernels return) and breaks this
// communicator: the failed collective's error becomes the caller's stream
// error (a host function behind every collective reports it), and every
// later call fails at once with the first error (communicator.h). NCCL's
// host side of a call can itself wait on peers (lazy connection set-up): the
// module bounds that by the same timeout, and the call then fails and breaks
// the communicator. A failure after part of a collective was enqueued still
// orders the caller's stream after it. The watchdog cannot name the peer
// that hung (NCCL does not say): the message names the collective, this rank
// and the timeout. NCCL_COMM_BLOCKING=1 (which would make NCCL's calls block
// past every timeout) is refused.
//
// Bootstrap. The ranks share rank 0's NCCL unique id (128 bytes) before
// ncclCommInitRank: through `share_id` (the TCP rendezvous for torchrun-style
// launches, an MPI broadcast under mpirun: create_communicator does this).
// Or, from a trainer that has its own NCCL communicator (`parent`), a child
// split from it: the engine's collectives never match the trainer's, and a
// timeout aborts the child only.
// ncclCommInitRank is non-blocking and polled up to the timeout, so a rank
// that never joins fails the others instead of hanging them; a stop request
// (`cancel`) ends that wait at once.
//
// Multi-process on one GPU is not possible (NCCL refuses two ranks on one
// device): each rank needs its own GPU (LOCAL_RANK picks it in the trainer).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "comm/rendezvous.h"

namespace strata::comm {

// Broadcasts rank 0's blob to every rank and returns it: the bootstrap's
// side channel. Rank 0 makes the blob with `make` (the NCCL id: it starts
// NCCL's bootstrap root listener) when its side channel is ready: the TCP
// rendezvous calls it once MASTER_PORT is taken, so that listener cannot
// take it (rendezvous.h). The other ranks never call it.
using ShareBlob = std::function<Result<std::vector<uint8_t>>(const BlobMaker& make)>;

// The default scratch (NcclCommOptions::scratch_bytes 0), from the device
// backend's pool: callers that plan device memory reserve it.
inline constexpr std::size_t kNcclDefaultScratch = 64ull << 20;

struct NcclCommOptions {
  int rank = 0;
  int world_size = 1;
  double timeout_s = 300.0;  // per collective and for joining; > 0
  ShareBlob share_id;        // required when world_size > 1
  // Scratch for the rank-order sums, bytes (a collective larger than
  // scratch_bytes / world_size per rank runs in chunks). 0: kNcclDefaultScratch.
  std::size_t scratch_bytes = 0;
  // The caller's own ncclComm_t (borrowed for the call): the communicator is
  // a child of it (ncclCommSplit, collective over its ranks), whose rank and
  // size replace rank/world_size, and share_id is not used. Its GPU must be
  // the device backend's.
  void* parent = nullptr;
  // A stop request (CommOptions::cancel), read every millisecond while the
  // ranks join (ncclCommInitRank, ncclCommSplit): once true, the
  // communicator is aborted and the call fails with kCancelled. Only the
  // create call reads it. Empty: waits up to timeout_s.
  std::function<bool()> cancel = nullptr;
};

// True when this build has the NCCL module (STRATA_HAVE_NCCL).
bool nccl_backend_built();

// Loads the module and creates the communicator on `device` (a CUDA backend;
// it must outlive the communicator). Collective over the ranks: every rank
// calls it. Errors: kInvalidArgument (not a CUDA backend, bad rank/world,
// timeout <= 0, no share_id with N > 1), kUnavailable (not built; the module
// or libnccl does not load: dlopen's text; a rank did not join within the
// timeout), kCancelled (`cancel` while the ranks joined), and NCCL's errors
// as the module reports them.
Result<std::unique_ptr<Communicator>> create_nccl_communicator(DeviceBackend* device, const NcclCommOptions& options);

}  // namespace strata::comm
