#include "comm/mpi_comm.h"

#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "comm/p2p_communicator.h"
#include "device/host_backend.h"

namespace strata::comm {
namespace {

using Clock = std::chrono::steady_clock;

// Process-wide MPI state: who initialized it and at which thread level.
std::mutex g_init_mu;
bool g_we_initialized = false;
// A communicator broke (a peer timed out, a transport error): the job cannot
// finish collectively, so finalize_mpi() aborts instead of finalizing.
std::atomic<bool> g_any_broken{false};
int g_provided = MPI_THREAD_SINGLE;
// Held around every MPI call when the library is only MPI_THREAD_SERIALIZED.
std::mutex g_serial_mu;

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
  }
  return "unknown thread level";
}

std::string mpi_error_text(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(text, static_cast<std::size_t>(len));
}

void finalize_at_exit() { finalize_mpi(); }

Status ensure_mpi() {
  std::lock_guard<std::mutex> lock(g_init_mu);
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return Status(StatusCode::kUnavailable, "MPI was already finalized in this process");
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = MPI_THREAD_SINGLE;
  if (!initialized) {
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS)
      return Status(StatusCode::kUnavailable, fmt::format("MPI_Init_thread failed: {}", mpi_error_text(rc)));
    g_we_initialized = true;
    std::atexit(finalize_at_exit);
  } else {
    MPI_Query_thread(&provided);
  }
  g_provided = provided;
  if (provided < MPI_THREAD_SERIALIZED)
    return Status(StatusCode::kUnavailable,
                  fmt::format("MPI provides {}; Strata's collectives run on stream worker threads and need "
                              "MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE",
                              thread_level_name(provided)));
  return Status();
}

// Locks g_serial_mu only when MPI is not MPI_THREAD_MULTIPLE.
class MpiLock {
 public:
  MpiLock() {
    if (g_provided < MPI_THREAD_MULTIPLE) lock_.emplace(g_serial_mu);
  }

 private:
  std::optional<std::unique_lock<std::mutex>> lock_;
};

constexpr std::size_t kMaxPiece = std::size_t{1} << 30;  // bytes per MPI message

// One collective's MPI requests while it runs.
struct MpiOp final : P2pOp {
  int tag_base = 0;
  std::vector<MPI_Request> reqs;
  struct Info {
    int peer;
    bool recv;
    std::size_t bytes;
  };
  std::vector<Info> info;
};

class MpiCommunicator final : public P2pCommunicator {
 public:
  MpiCommunicator(DeviceBackend* device, MPI_Comm comm, int rank, int world, int tag_ub, double timeout_s)
      : P2pCommunicator(device, rank, world, timeout_s), comm_(comm), tag_ub_(tag_ub) {}

  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MpiLock lock;
    MPI_Comm_free(&comm_);
  }

  const char* backend_name() const override { return "mpi"; }

 private:
  std::unique_ptr<P2pOp> make_op(const char* name, uint64_t seq) override {
    auto op = new_op<MpiOp>(name, seq);
    // Tags: 2 per collective (phases), cycling below the MPI tag bound.
    op->tag_base = static_cast<int>((seq % (static_cast<uint64_t>(tag_ub_) / 2)) * 2);
    return op;
  }

  // Posts one transfer (split into pieces of at most kMaxPiece bytes; the
  // pieces of one tag from one peer match in order, MPI's non-overtaking rule).
  Status post(P2pOp& base, bool recv, void* buf, std::size_t bytes, int peer, int phase) override {
    auto& op = static_cast<MpiOp&>(base);
    const int tag = op.tag_base + phase;
    std::size_t off = 0;
    do {
      const std::size_t n = std::min(kMaxPiece, bytes - off);
      MPI_Request req = MPI_REQUEST_NULL;
      int rc;
      {
        MpiLock lock;
        char* p = static_cast<char*>(buf) + (buf ? off : 0);
        rc = recv ? MPI_Irecv(p, static_cast<int>(n), MPI_BYTE, peer, tag, comm_, &req)
                  : MPI_Isend(p, static_cast<int>(n), MPI_BYTE, peer, tag, comm_, &req);
      }
      if (rc != MPI_SUCCESS)
        return Status(StatusCode::kIoError, fmt::format("{}: {} of {} bytes {} rank {} failed: {}", op.where(),
                                                        recv ? "MPI_Irecv" : "MPI_Isend", n, recv ? "from" : "to",
                                                        peer, mpi_error_text(rc)));
      op.reqs.push_back(req);
      op.info.push_back({peer, recv, n});
      off += n;
    } while (off < bytes);
    return Status();
  }

  // Polls the op's transfers until all are done or the deadline passes:
  // yielding for 1 ms, then every 100 us. A collective enqueued ahead (stage
  // 3's gather of the next group) waits here while the trainer computes, on
  // the same cores: a longer spin (20 ms once) took their time.
  Status wait(P2pOp& base) override {
    auto& op = static_cast<MpiOp&>(base);
    const auto deadline = op.start + std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::duration<double>(timeout_s()));
    const auto spin_until = Clock::now() + std::chrono::milliseconds(1);
    std::vector<MPI_Status> statuses(op.reqs.size());
    for (;;) {
      int done = 0, rc;
      {
        MpiLock lock;
        rc = MPI_Testall(static_cast<int>(op.reqs.size()), op.reqs.data(), &done, statuses.data());
      }
      if (rc != MPI_SUCCESS) {
        std::size_t bad = 0;
        int err = rc;
        if (rc == MPI_ERR_IN_STATUS)
          for (std::size_t i = 0; i < statuses.size(); ++i)
            if (statuses[i].MPI_ERROR != MPI_SUCCESS && statuses[i].MPI_ERROR != MPI_ERR_PENDING) {
              bad = i;
              err = statuses[i].MPI_ERROR;
              break;
            }
        return Status(StatusCode::kIoError,
                      fmt::format("{}: {} rank {} failed: {}", op.where(),
                                  op.info[bad].recv ? "receive from" : "send to", op.info[bad].peer,
                                  mpi_error_text(err)));
      }
      if (done) {
        op.reqs.clear();
        op.info.clear();
        return Status();
      }
      const auto now = Clock::now();
      if (now >= deadline) break;
      if (now < spin_until)
        sched_yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    // Timed out: name the first peer we still wait on (a receive before a send:
    // a missing receive is the peer that did not send).
    std::optional<std::size_t> first_recv, first_send;
    {
      MpiLock lock;
      for (std::size_t i = 0; i < op.reqs.size(); ++i) {
        int flag = 0;
        if (op.reqs[i] != MPI_REQUEST_NULL) MPI_Test(&op.reqs[i], &flag, MPI_STATUS_IGNORE);
        if (op.reqs[i] == MPI_REQUEST_NULL) continue;
        auto& first = op.info[i].recv ? first_recv : first_send;
        if (!first) first = i;
      }
    }
    const std::size_t i = first_recv ? *first_recv : first_send.value_or(0);
    return Status(StatusCode::kUnavailable,
                  fmt::format("{}: timed out after {:g} s waiting for rank {} ({} of {} bytes)", op.where(),
                              timeout_s(), op.info[i].peer, op.info[i].recv ? "receive" : "send",
                              op.info[i].bytes));
  }

  // Cancels what is still pending (receives into the caller's buffers must
  // not land later) and lets MPI free the requests when it can; the op's
  // staging stays until the communicator is destroyed (a cancel may come too
  // late for a matched receive).
  void abandon(P2pOp& base) override {
    auto& op = static_cast<MpiOp&>(base);
    if (op.stage && !op.reqs.empty()) graveyard_add(std::move(op.stage));
    MpiLock lock;
    for (MPI_Request& r : op.reqs) {
      if (r == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&r);
      MPI_Request_free(&r);
    }
    op.reqs.clear();
  }

  void on_broken(const Status& /*error*/) override { g_any_broken = true; }

  MPI_Comm comm_;
  const int tag_ub_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> create_mpi_communicator(DeviceBackend* device, const MpiCommOptions& options) {
  if (device == nullptr) return Status(StatusCode::kInvalidArgument, "mpi communicator: null device backend");
  if (device->kind() != DeviceKind::kHost)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("mpi communicator: needs the host device backend (got {}); CUDA buffers need NCCL",
                              device->name()));
  if (!(options.timeout_s > 0))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("mpi communicator: timeout_s must be > 0 (got {})", options.timeout_s));
  MPI_Comm base = MPI_COMM_WORLD;
  if (options.fortran_comm != -1) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("mpi communicator: given communicator handle {}, but MPI is not initialized (the "
                                "caller that made the communicator initializes MPI)",
                                options.fortran_comm));
    if (options.fortran_comm < std::numeric_limits<MPI_Fint>::min() ||
        options.fortran_comm > std::numeric_limits<MPI_Fint>::max())
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("mpi communicator: {} is not a Fortran communicator handle", options.fortran_comm));
    base = MPI_Comm_f2c(static_cast<MPI_Fint>(options.fortran_comm));
    if (base == MPI_COMM_NULL)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("mpi communicator: handle {} is not a communicator MPI knows (pass "
                                "MPI_Comm_c2f(comm), or comm.py2f() from mpi4py)",
                                options.fortran_comm));
  }
  STRATA_RETURN_IF_ERROR(ensure_mpi());
  MpiLock lock;
  MPI_Comm comm = MPI_COMM_NULL;
  // A handle MPI does not know is reported on MPI_COMM_WORLD, whose handler
  // aborts the job by default: return the error instead, for this one call.
  MPI_Errhandler world_handler = MPI_ERRHANDLER_NULL;
  MPI_Comm_get_errhandler(MPI_COMM_WORLD, &world_handler);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rc = MPI_Comm_dup(base, &comm);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, world_handler);
  MPI_Errhandler_free(&world_handler);
  if (rc != MPI_SUCCESS && options.fortran_comm != -1)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("mpi communicator: duplicating the communicator of handle {} failed ({}): pass "
                              "MPI_Comm_c2f(comm), or comm.py2f() from mpi4py",
                              options.fortran_comm, mpi_error_text(rc)));
  if (rc != MPI_SUCCESS)
    return Status(StatusCode::kUnavailable, fmt::format("mpi communicator: MPI_Comm_dup failed: {}", mpi_error_text(rc)));
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int rank = 0, world = 1, flag = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &world);
  int* tag_ub = nullptr;
  MPI_Comm_get_attr(comm, MPI_TAG_UB, &tag_ub, &flag);
  const int ub = (flag && tag_ub) ? *tag_ub : 32767;
  return std::unique_ptr<Communicator>(new MpiCommunicator(device, comm, rank, world, ub, options.timeout_s));
}

// mpi_broadcast_blob's message: a header (0: a blob follows; else the
// maker's status code, and its reason follows as text), then the blob padded
// to `bytes` or the reason cut to fit.
namespace {
constexpr std::size_t kBlobHeader = 8;
constexpr std::size_t kMinReason = 1024;  // room for the reason when the blob is small

std::size_t blob_message_size(std::size_t bytes) { return kBlobHeader + std::max(bytes, kMinReason); }

std::vector<uint8_t> encode_made(const Result<std::vector<uint8_t>>& made, std::size_t bytes) {
  std::vector<uint8_t> msg(blob_message_size(bytes), 0);
  if (made.ok()) {
    std::copy(made->begin(), made->end(), msg.begin() + kBlobHeader);  // run_blob_maker kept it within `bytes`
    return msg;
  }
  uint32_t code = static_cast<uint32_t>(made.status().code());
  if (code == 0) code = static_cast<uint32_t>(StatusCode::kInternal);  // a failure without a code stays one
  const std::string& why = made.status().message();
  std::memcpy(msg.data(), &code, sizeof code);
  std::memcpy(msg.data() + kBlobHeader, why.data(), std::min(why.size(), msg.size() - kBlobHeader - 1));
  return msg;
}
}  // namespace

Result<std::vector<uint8_t>> mpi_broadcast_blob(const BlobMaker& make, std::size_t bytes,
                                                const MpiCommOptions& options) {
  STRATA_ASSIGN_OR_RETURN(auto host, create_host_backend(HostBackendOptions{1u << 20, false}));
  STRATA_ASSIGN_OR_RETURN(auto mpi, create_mpi_communicator(host.get(), options));
  STRATA_ASSIGN_OR_RETURN(DeviceStream * stream, host->create_stream("bootstrap"));
  std::vector<uint8_t> msg = mpi->rank() == 0 ? encode_made(run_blob_maker(make, bytes), bytes)
                                              : std::vector<uint8_t>(blob_message_size(bytes), 0);
  Status st = mpi->broadcast(msg.data(), msg.size(), 0, stream);
  Status synced = host->synchronize(stream);
  if (st.ok()) st = synced;
  (void)host->destroy_stream(stream);
  if (!st.ok()) return st.with_context("broadcast over MPI");
  uint32_t code = 0;
  std::memcpy(&code, msg.data(), sizeof code);
  if (code != 0) {
    if (code > static_cast<uint32_t>(StatusCode::kInternal)) code = static_cast<uint32_t>(StatusCode::kInternal);
    const char* why = reinterpret_cast<const char*>(msg.data() + kBlobHeader);
    return Status(static_cast<StatusCode>(code),
                  fmt::format("rank 0 could not make its blob: {}", std::string(why, strnlen(why, msg.size() - kBlobHeader))));
  }
  return std::vector<uint8_t>(msg.begin() + kBlobHeader, msg.begin() + kBlobHeader + bytes);
}

void finalize_mpi() {
  std::lock_guard<std::mutex> lock(g_init_mu);
  if (!g_we_initialized) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && g_any_broken) {
    // MPI_Finalize waits for every peer, and a peer that hung or died never
    // comes: end the job instead (mpirun then stops the other ranks). The
    // error that broke the communicator was reported already.
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (!finalized) MPI_Finalize();
  g_we_initialized = false;
}

}  // namespace strata::comm
