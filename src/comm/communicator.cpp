#include "comm/communicator.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "comm/bootstrap.h"
#include "comm/mpi_comm.h"
#include "comm/nccl_comm.h"
#include "comm/rendezvous.h"
#include "comm/self_comm.h"
#include "comm/socket_io.h"
#include "comm/tcp_comm.h"
#include "device/host_backend.h"
#include "strata/strata_config.h"

namespace strata::comm {
namespace {

// Under mpirun: rank 0's blob to every rank with an MPI broadcast (a host
// backend and an MPI communicator made for it; MPI stays initialized). A
// maker that fails on rank 0 fails every rank with its reason.
Result<std::vector<uint8_t>> mpi_share(const BlobMaker& make, std::size_t bytes, const CommOptions& options) {
#if STRATA_HAVE_MPI
  MpiCommOptions mo;
  mo.timeout_s = options.timeout_s;
  mo.fortran_comm = options.mpi_fortran_comm;
  return mpi_broadcast_blob(make, bytes, mo);
#else
  (void)make, (void)bytes, (void)options;
  return Status(StatusCode::kUnavailable,
                "under mpirun the NCCL id travels over MPI, which is not in this build; launch torchrun-style "
                "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) instead");
#endif
}

// The store at MASTER_PORT (torchrun's agent's) outlives a job attempt and
// serves every communicator of this one: the key names both (every rank
// creates its communicators in the same order). The attempt is
// TORCHELASTIC_RESTART_COUNT on one node only: that count is each agent's
// own, and on several nodes (GROUP_WORLD_SIZE > 1) a node whose worker did
// not fail restarts without counting, so the ranks' keys would differ and
// never meet. There the key leaves it out: a restarted round that finds the
// first's keys in the agent's store is refused by name (rendezvous.h), and
// with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 each round's MASTER_PORT is a new
// one that rank 0 serves itself, so the keys are new.
// GROUP_WORLD_SIZE, torchrun's number of nodes (agents), when over 1; else null.
const char* torchrun_nodes() {
  const char* nodes = std::getenv("GROUP_WORLD_SIZE");
  return nodes != nullptr && *nodes != '\0' && std::strcmp(nodes, "1") != 0 ? nodes : nullptr;
}

std::string store_key(const char* backend) {
  static std::atomic<uint64_t> sequence{0};
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const char* attempt = restart != nullptr && *restart && torchrun_nodes() == nullptr ? restart : "0";
  return fmt::format("{}/{}/{}", backend, attempt, sequence++);
}

// What a taken key means for store_key()'s keys: "" (another job, or a
// second RANK=0) but for a torchrun job on several nodes, whose restarted
// round finds the first round's keys in the agent's store.
std::string store_key_taken_hint() {
  const char* nodes = torchrun_nodes();
  if (std::getenv("TORCHELASTIC_RESTART_COUNT") == nullptr || nodes == nullptr) return "";
  return fmt::format(
      "an earlier attempt of this torchrun job left its rendezvous in the agent's store (on {} nodes the restart "
      "count differs from node to node, so the key cannot tell the attempts apart); for jobs that restart across "
      "nodes set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so that each attempt meets on a new port",
      nodes);
}

// The rendezvous of a torchrun-style launch under store_key(backend).
RendezvousOptions rendezvous_options(const LaunchInfo& li, const CommOptions& options, const char* backend) {
  RendezvousOptions ro;
  ro.addr = li.master_addr;
  ro.port = li.master_port;
  ro.rank = li.rank;
  ro.world_size = li.world_size;
  ro.timeout_s = options.timeout_s;
  ro.key = store_key(backend);
  ro.taken_hint = store_key_taken_hint();
  return ro;
}

// The ranks: the caller's (CommOptions::ranks, checked) or the launcher's.
Result<LaunchInfo> launch_of(const CommOptions& options) {
  if (!options.ranks) return detect_launch();
  const LaunchInfo& li = *options.ranks;
  if (li.launcher != Launcher::kTorchrun)
    return Status(StatusCode::kInvalidArgument,
                  "create_communicator: given ranks must be torchrun-style (a TCPStore address and port)");
  if (li.world_size < 1 || li.rank < 0 || li.rank >= li.world_size)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("create_communicator: given rank {} of world size {}: expected 0 <= rank < world size",
                              li.rank, li.world_size));
  if (li.world_size > 1 && (li.master_addr.empty() || li.master_port == 0))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("create_communicator: given rank {} of {} without the store's address and port "
                              "(got '{}':{})",
                              li.rank, li.world_size, li.master_addr, li.master_port));
  return li;
}

// TCP over the torchrun-style launcher's ranks (or the caller's).
Result<std::unique_ptr<Communicator>> create_tcp(DeviceBackend* device, const CommOptions& options) {
  STRATA_ASSIGN_OR_RETURN(LaunchInfo li, launch_of(options));
  if (li.launcher == Launcher::kMpirun)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("the tcp communicator under mpirun ({} ranks): its ranks come from a torchrun-style "
                              "launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); mpirun's meet over the mpi backend",
                              li.world_size));
  TcpCommOptions to;
  to.master_addr = li.master_addr;
  to.master_port = li.master_port;
  to.rank = li.rank;
  to.world_size = li.world_size;
  to.timeout_s = options.timeout_s;
  to.hold_store = options.hold_store;
  if (li.world_size > 1) {
    to.key = store_key("tcp");
    to.taken_hint = store_key_taken_hint();
  }
  return create_tcp_communicator(device, to);
}

// kAuto, resolved: GPU ranks meet over NCCL, host ranks over MPI (mpirun)
// or TCP (torchrun style, or the caller's ranks); one rank needs none.
Result<CommBackendKind> auto_kind(DeviceKind device, const CommOptions& options) {
  if (device != DeviceKind::kCuda && !options.ranks && mpi_backend_built() &&
      std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr)
    return CommBackendKind::kMpi;
  STRATA_ASSIGN_OR_RETURN(LaunchInfo li, launch_of(options));
  if (device == DeviceKind::kCuda) return li.world_size > 1 ? CommBackendKind::kNccl : CommBackendKind::kSelf;
  return li.launcher == Launcher::kTorchrun && li.world_size > 1 ? CommBackendKind::kTcp : CommBackendKind::kSelf;
}

// A communicator and what must live as long as it: rank 0's rendezvous
// store, held (rendezvous.h, "Holding the port").
class Holding final : public Communicator {
 public:
  Holding(std::unique_ptr<Communicator> comm, std::shared_ptr<void> held)
      : held_(std::move(held)), comm_(std::move(comm)) {}
  int rank() const override { return comm_->rank(); }
  int world_size() const override { return comm_->world_size(); }
  const char* backend_name() const override { return comm_->backend_name(); }
  DeviceBackend* device() const override { return comm_->device(); }
  Status all_gather(const void* send, void* recv, std::size_t bytes, DeviceStream* stream) override {
    return comm_->all_gather(send, recv, bytes, stream);
  }
  Status reduce_scatter(const float* send, float* recv, std::size_t count, DeviceStream* stream) override {
    return comm_->reduce_scatter(send, recv, count, stream);
  }
  Status all_reduce(const float* send, float* recv, std::size_t count, DeviceStream* stream) override {
    return comm_->all_reduce(send, recv, count, stream);
  }
  Status broadcast(void* data, std::size_t bytes, int root, DeviceStream* stream) override {
    return comm_->broadcast(data, bytes, root, stream);
  }
  Status barrier(DeviceStream* stream) override { return comm_->barrier(stream); }

 private:
  std::shared_ptr<void> held_;            // destroyed after comm_
  std::unique_ptr<Communicator> comm_;
};

// NCCL over the launcher's ranks: rank 0's NCCL id travels by MPI (mpirun)
// or the TCP rendezvous (torchrun style).
Result<std::unique_ptr<Communicator>> create_nccl(DeviceBackend* device, const CommOptions& options) {
  if (options.nccl_parent != nullptr) {
    NcclCommOptions no;
    no.timeout_s = options.timeout_s;
    no.parent = options.nccl_parent;
    no.cancel = options.cancel;
    return create_nccl_communicator(device, no);
  }
  STRATA_ASSIGN_OR_RETURN(LaunchInfo li, launch_of(options));
  NcclCommOptions no;
  no.rank = li.rank;
  no.world_size = li.world_size;
  no.timeout_s = options.timeout_s;
  no.cancel = options.cancel;
  auto held = std::make_shared<std::shared_ptr<void>>();  // rank 0's store, where it serves one
  if (li.launcher == Launcher::kTorchrun) {
    RendezvousOptions ro = rendezvous_options(li, options, "nccl");
    ro.hold = options.hold_store ? held.get() : nullptr;
    no.share_id = [ro, held](const BlobMaker& make) { return rendezvous_broadcast_lazy(ro, make); };
  } else if (li.launcher == Launcher::kMpirun) {
    no.share_id = [options](const BlobMaker& make) { return mpi_share(make, 128, options); };
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, create_nccl_communicator(device, no));
  if (*held == nullptr) return comm;
  return std::unique_ptr<Communicator>(std::make_unique<Holding>(std::move(comm), std::move(*held)));
}

}  // namespace

const char* comm_backend_kind_name(CommBackendKind kind) {
  switch (kind) {
    case CommBackendKind::kAuto: return "auto";
    case CommBackendKind::kSelf: return "self";
    case CommBackendKind::kMpi: return "mpi";
    case CommBackendKind::kNccl: return "nccl";
    case CommBackendKind::kTcp: return "tcp";
  }
  return "?";
}

Result<CommBackendKind> parse_comm_backend_kind(std::string_view text) {
  for (CommBackendKind k : {CommBackendKind::kAuto, CommBackendKind::kSelf, CommBackendKind::kMpi, CommBackendKind::kNccl,
                            CommBackendKind::kTcp})
    if (text == comm_backend_kind_name(k)) return k;
  return Status(StatusCode::kInvalidArgument,
                fmt::format("communicator backend '{}': expected auto, self, mpi, nccl or tcp", text));
}

bool mpi_backend_built() { return STRATA_HAVE_MPI != 0; }

Result<std::unique_ptr<Communicator>> create_communicator(DeviceBackend* device, const CommOptions& options) {
  if (device == nullptr) return Status(StatusCode::kInvalidArgument, "create_communicator: null device backend");
  net::CancelScope cancel(options.cancel);  // the rendezvous and connections below run on this thread
  if (!(options.timeout_s > 0))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("create_communicator: timeout_s must be > 0 (got {})", options.timeout_s));
  CommBackendKind kind = options.kind;
  if (options.nccl_parent != nullptr) {
    if (kind != CommBackendKind::kAuto && kind != CommBackendKind::kNccl)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("create_communicator: an NCCL communicator to split was given with the {} backend",
                                comm_backend_kind_name(kind)));
    kind = CommBackendKind::kNccl;
  }
  if (options.ranks && (kind == CommBackendKind::kSelf || kind == CommBackendKind::kMpi ||
                        options.nccl_parent != nullptr))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("create_communicator: ranks were given with the {} (the ranks are its own)",
                              options.nccl_parent != nullptr ? "NCCL communicator to split"
                                                             : std::string(comm_backend_kind_name(kind)) + " backend"));
  if (kind == CommBackendKind::kAuto) {
    STRATA_ASSIGN_OR_RETURN(kind, auto_kind(device->kind(), options));
  }
  switch (kind) {
    case CommBackendKind::kSelf:
      return create_self_communicator(device);
    case CommBackendKind::kMpi: {
#if STRATA_HAVE_MPI
      MpiCommOptions mo;
      mo.timeout_s = options.timeout_s;
      mo.fortran_comm = options.mpi_fortran_comm;
      return create_mpi_communicator(device, mo);
#else
      return Status(StatusCode::kUnavailable,
                    "the MPI communicator is not in this build (configured with STRATA_MPI=OFF or without Open MPI; "
                    "apt-get install libopenmpi-dev openmpi-bin and reconfigure)");
#endif
    }
    case CommBackendKind::kNccl:
      return create_nccl(device, options);
    case CommBackendKind::kTcp:
      return create_tcp(device, options);
    case CommBackendKind::kAuto:
      break;
  }
  return Status(StatusCode::kInternal, "create_communicator: unhandled backend kind");
}

Status refuse_to_meet(DeviceKind device, const CommOptions& options, const std::string& why) {
  net::CancelScope cancel(options.cancel);
  if (!(options.timeout_s > 0) || options.nccl_parent != nullptr) return Status();
  CommBackendKind kind = options.kind;
  if (kind == CommBackendKind::kAuto) {
    STRATA_ASSIGN_OR_RETURN(kind, auto_kind(device, options));
  }
  if (kind != CommBackendKind::kTcp && kind != CommBackendKind::kNccl) return Status();
  STRATA_ASSIGN_OR_RETURN(LaunchInfo li, launch_of(options));
  if (li.launcher != Launcher::kTorchrun || li.world_size <= 1) return Status();
  return rendezvous_refuse(rendezvous_options(li, options, kind == CommBackendKind::kNccl ? "nccl" : "tcp"), why);
}

}  // namespace strata::comm
