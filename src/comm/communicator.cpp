#include "comm/communicator.h"

#include <cstdlib>

#include <fmt/format.h>

#include "comm/mpi_comm.h"
#include "comm/self_comm.h"
#include "strata/strata_config.h"

namespace strata::comm {

const char* comm_backend_kind_name(CommBackendKind kind) {
  switch (kind) {
    case CommBackendKind::kAuto: return "auto";
    case CommBackendKind::kSelf: return "self";
    case CommBackendKind::kMpi: return "mpi";
    case CommBackendKind::kNccl: return "nccl";
  }
  return "?";
}

Result<CommBackendKind> parse_comm_backend_kind(std::string_view text) {
  for (CommBackendKind k : {CommBackendKind::kAuto, CommBackendKind::kSelf, CommBackendKind::kMpi, CommBackendKind::kNccl})
    if (text == comm_backend_kind_name(k)) return k;
  return Status(StatusCode::kInvalidArgument,
                fmt::format("communicator backend '{}': expected auto, self, mpi or nccl", text));
}

bool mpi_backend_built() { return STRATA_HAVE_MPI != 0; }

Result<std::unique_ptr<Communicator>> create_communicator(DeviceBackend* device, const CommOptions& options) {
  if (device == nullptr) return Status(StatusCode::kInvalidArgument, "create_communicator: null device backend");
  if (!(options.timeout_s > 0))
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("create_communicator: timeout_s must be > 0 (got {})", options.timeout_s));
  CommBackendKind kind = options.kind;
  if (kind == CommBackendKind::kAuto)
    kind = (mpi_backend_built() && std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr) ? CommBackendKind::kMpi
                                                                                  : CommBackendKind::kSelf;
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
      return Status(StatusCode::kUnavailable,
                    "the NCCL communicator does not exist yet (issue 14); use mpi over the host backend");
    case CommBackendKind::kAuto:
      break;
  }
  return Status(StatusCode::kInternal, "create_communicator: unhandled backend kind");
}

}  // namespace strata::comm
