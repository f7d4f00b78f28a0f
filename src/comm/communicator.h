// Communicator: collectives between the ranks of a data-parallel job, on
// buffers of a DeviceBackend's memory, ordered on a DeviceStream.
//
// Backends: SelfCommunicator (src/comm/self_comm.h; one rank, always
// available: the 1-rank reference), MpiCommunicator (src/comm/mpi_comm.h;
// Open MPI over host-backend buffers, built when CMake finds MPI),
// TcpCommunicator (src/comm/tcp_comm.h; TCP sockets over host-backend
// buffers, for host ranks launched torchrun-style; always built),
// NcclCommunicator (src/comm/nccl_comm.h; NCCL over CUDA-backend buffers,
// built when CMake finds CUDA and NCCL; never run on a GPU yet).
// create_communicator() picks one and says why one is unavailable.
//
// Ordering. Every collective is *enqueued* on the stream the caller passes
// and runs once the stream reaches it, like a copy or a kernel: later work
// on that stream waits for it, other streams order against it through
// events. An Ok return means only that the arguments were accepted; an error
// while it runs (a peer that timed out, a transport error) becomes the
// stream's error, returned by the next synchronize()/query() of the stream
// (device_backend.h's async error model). On the host backend a collective
// is a host function on the stream: it occupies the stream's worker thread
// until done.
//
// Matching across ranks. Every rank must enqueue the same collectives, with
// the same sizes, in the same order (NCCL's rule). The order is that of the
// calls on this Communicator across all streams: each call takes the next
// sequence number when it is enqueued, and messages of different calls never
// match each other, so collectives on different streams may run at the same
// time. Callers that enqueue from several threads serialize those calls so
// that every rank makes them in the same order.
//
// Determinism. Sums are fp32 and never use the transport's own reduction
// (whose order depends on the algorithm the library picks). The fixed order:
//   reduce_scatter: rank r receives slice r of every rank's buffer and
//     computes out = in_0; out += in_1; ...; out += in_{N-1} element by
//     element (fp32 adds, no FMA, ranks in order 0..N-1);
//   all_reduce: the same per element over a fixed split of the buffer into
//     N contiguous chunks (chunk r = [r*count/N, (r+1)*count/N), rounded
//     down), each summed by one rank in rank order, then all-gathered.
// So every element of a sum is ((p_0 + p_1) + p_2) + ... + p_{N-1} of the N
// ranks' values: bit-identical run to run, on every rank, and bit-identical
// to a 1-rank sum of the same N partial buffers accumulated in rank order
// (acc = p_0; for r in 1..N-1: acc[i] += p_r[i]). It differs from a sum in
// another order in the last bits, as any fp32 sum does.
//
// Memory. Buffers are the device backend's memory (host backend: RAM from
// alloc(), or any host memory) and must stay valid and unmodified until the
// collective has run (an event recorded after it completes). Sizes may be 0
// (the collective still matches across ranks and completes).
//
// Failure. A collective that cannot complete within the communicator's
// timeout fails with kUnavailable naming the collective, this rank and (MPI;
// NCCL does not tell) the peer it was waiting for. After a failure the communicator is broken: the
// pending transfers are abandoned and every later collective fails at once
// with the first error (like ncclCommAbort; make a new communicator, which in
// practice means a new job).
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "comm/bootstrap.h"
#include "common/status.h"
#include "device/device_backend.h"

namespace strata::comm {

class Communicator {
 public:
  virtual ~Communicator() = default;

  // This process's rank, 0 .. world_size()-1. Constant.
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // "self", "mpi", "tcp", "nccl". Constant.
  virtual const char* backend_name() const = 0;
  // The device backend whose buffers and streams the collectives take.
  virtual DeviceBackend* device() const = 0;

  // recv[r*bytes_per_rank, (r+1)*bytes_per_rank) = rank r's send[0, bytes_per_rank)
  // for every rank r. recv holds world_size()*bytes_per_rank bytes. send may
  // be recv's own slot (recv + rank()*bytes_per_rank: in place); no other
  // overlap.
  virtual Status all_gather(const void* send, void* recv, std::size_t bytes_per_rank, DeviceStream* stream) = 0;

  // recv[0, count) = sum over ranks, in rank order, of that rank's
  // send[rank()*count, (rank()+1)*count). send holds world_size()*count
  // floats; recv must not overlap send.
  virtual Status reduce_scatter(const float* send, float* recv, std::size_t count, DeviceStream* stream) = 0;

  // recv[i] = sum over ranks, in rank order, of send[i] (the fixed order
  // above). send == recv is allowed (in place); no other overlap.
  virtual Status all_reduce(const float* send, float* recv, std::size_t count, DeviceStream* stream) = 0;

  // data[0, bytes) on every rank = root's data. root in [0, world_size()).
  virtual Status broadcast(void* data, std::size_t bytes, int root, DeviceStream* stream) = 0;

  // Completes on every rank once every rank has reached it on its stream.
  virtual Status barrier(DeviceStream* stream) = 0;
};

enum class CommBackendKind { kAuto, kSelf, kMpi, kNccl, kTcp };
const char* comm_backend_kind_name(CommBackendKind kind);
// "auto" | "self" | "mpi" | "nccl" | "tcp"; kInvalidArgument names the text otherwise.
Result<CommBackendKind> parse_comm_backend_kind(std::string_view text);

struct CommOptions {
  CommBackendKind kind = CommBackendKind::kAuto;
  // A collective that has not completed this many seconds after it started
  // running fails (kUnavailable naming the peer). > 0.
  double timeout_s = 300.0;
  // kMpi: the ranks of this communicator (Fortran handle, see mpi_comm.h);
  // -1: MPI_COMM_WORLD.
  int64_t mpi_fortran_comm = -1;
  // kNccl: the caller's own ncclComm_t; the communicator is a child of it
  // (nccl_comm.h NcclCommOptions::parent) instead of a launcher bootstrap.
  void* nccl_parent = nullptr;
  // kTcp, kNccl, kAuto: the ranks as the caller's own process group has them
  // instead of the launcher's environment: rank, world_size and the TCPStore
  // the ranks meet through (master_addr, master_port; launcher must be
  // kTorchrun, local_rank is not used). For trainers whose processes were
  // started without RANK and WORLD_SIZE in their environment (a process
  // group made with init_process_group(rank=, world_size=) by
  // torch.multiprocessing.spawn, its own launcher, ...). Unset: the
  // environment (bootstrap.h).
  std::optional<LaunchInfo> ranks = std::nullopt;
  // kTcp, kNccl: while the ranks meet (the rendezvous and the connections;
  // NCCL's own join, ncclCommInitRank or ncclCommSplit), a stop request (true
  // from `cancel`: a signal handler's flag) ends the wait at once with
  // kCancelled instead of at the timeout (net::CancelScope, NcclCommOptions).
  // Empty: waits until the timeout.
  std::function<bool()> cancel = nullptr;
  // kTcp, kNccl launched torchrun-style: where nothing serves a store at
  // MASTER_PORT, rank 0 serves the rendezvous itself; true: it goes on
  // serving it for the communicator's life (rendezvous.h "Holding the
  // port"), so a second job given the same MASTER_PORT fails at once on
  // every rank instead of meeting this job's ranks. Off by default: a
  // torch.distributed process group made after the communicator on the same
  // MASTER_PORT needs the port free (its rank 0 serves its TCPStore there).
  // strata finetune holds it.
  bool hold_store = false;
};

// True when this build has the MPI backend (STRATA_HAVE_MPI).
bool mpi_backend_built();

// kSelf: one rank, always. kMpi: the MPI backend (initializes MPI if needed;
// the device must be the host backend). kNccl: the NCCL backend over the
// launcher's ranks (bootstrap.h: under mpirun rank 0's NCCL id travels by an
// MPI broadcast, torchrun style by the TCP rendezvous at MASTER_ADDR:
// MASTER_PORT; no launcher: one rank); the device must be a CUDA backend.
// kTcp: the TCP backend over the torchrun-style launcher's ranks (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT; no launcher: one rank); the device
// must be the host backend.
// kAuto: a CUDA device: nccl when the launcher says N > 1 ranks, else self;
// the host backend: mpi when this build has MPI and the process runs under
// mpirun (OMPI_COMM_WORLD_SIZE set), tcp when launched torchrun-style with
// N > 1 ranks, else self.
// Errors: kUnavailable with the reason (built without MPI or NCCL: how to get
// it; the NCCL module or libnccl not loadable), kInvalidArgument (null device,
// timeout <= 0, MPI or TCP over a CUDA backend, NCCL over the host backend,
// TCP under mpirun, a malformed launcher environment or given ranks, given
// ranks with kSelf, kMpi or an NCCL parent), and those of the
// backend's constructor.
Result<std::unique_ptr<Communicator>> create_communicator(DeviceBackend* device, const CommOptions& options);

// For a rank that fails before it calls create_communicator() (its model or
// data unreadable, ...): the rendezvous that call would have run (the same
// key, the same sequence number taken) is refused with `why`
// (rendezvous_refuse: "rank R failed before the ranks met: <why>"), so every
// other rank fails at once naming this one instead of waiting out
// options.timeout_s for it. For TCP and NCCL ranks launched torchrun-style
// (`options.kind`; kAuto resolved as create_communicator() does, by the
// `device` kind); OK at once otherwise: under mpirun a rank that exits with
// an error ends the whole job, one rank has nobody to tell. Waits up to
// options.timeout_s for rank 0's store (options.cancel ends the wait).
Status refuse_to_meet(DeviceKind device, const CommOptions& options, const std::string& why);

}  // namespace strata::comm
