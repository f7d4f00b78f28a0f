// MpiCommunicator: the Communicator over Open MPI, for host-backend buffers
// (the host backend's device memory is RAM, so MPI reads and writes it
// directly). Built when CMake finds MPI (STRATA_MPI=AUTO/ON; STRATA_HAVE_MPI);
// without it these functions do not exist and create_communicator() says why.
//
// One rank per process of MPI_COMM_WORLD (launched by mpirun); the
// communicator works on its own duplicate of MPI_COMM_WORLD, so its messages
// never match the application's.
//
// How it runs. Each collective runs as a host function on the caller's
// stream, i.e. on that stream's worker thread. It posts nonblocking
// point-to-point transfers (MPI_Isend/MPI_Irecv; never MPI's own collectives,
// whose reduction order is the library's choice) and polls them (MPI_Testall)
// until done or until the deadline, `timeout_s` after it started running.
// Sums are then computed on this thread in the fixed rank order of
// communicator.h. Messages carry a tag made from the collective's sequence
// number, so collectives on different streams run concurrently without
// mixing. Transfers larger than 1 GiB are split (MPI counts are int).
//
// Threads. MPI is initialized on first use with MPI_Init_thread asking for
// MPI_THREAD_MULTIPLE (several stream workers may be inside MPI at once). If
// the library provides only MPI_THREAD_SERIALIZED, every MPI call of Strata's
// is made under one process-wide lock; less than that is refused
// (kUnavailable). If the application initialized MPI itself, its thread level
// is used the same way and Strata never finalizes it.
//
// Timeouts. A peer that died, hangs, or enqueued different collectives makes
// the waiting ranks fail with kUnavailable: "all_reduce #7 on rank 0 of 3
// (mpi): timed out after 5 s waiting for rank 2 (receive of 4096 bytes)".
// Transport errors (MPI_ERRORS_RETURN is set on the duplicate) are kIoError
// naming the call and the peer. Either breaks the communicator (see
// communicator.h); its pending receives are cancelled and its staging memory
// is kept until the communicator is destroyed.
//
// Note on mpirun: Open MPI's mpirun kills the whole job when one process
// exits without MPI_Finalize or with a nonzero status, unless the job runs
// with `--enable-recovery` (docs/comm.md); the timeout covers the peers that
// stay alive but stop participating, and the window before mpirun reacts.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "comm/rendezvous.h"

namespace strata::comm {

struct MpiCommOptions {
  double timeout_s = 300.0;  // per collective, from when it starts running; > 0
  // The communicator whose ranks these are, as a Fortran handle
  // (MPI_Comm_c2f(comm) in C, comm.py2f() in mpi4py): a trainer's own group
  // of ranks. -1: MPI_COMM_WORLD. Either way Strata works on a duplicate.
  // A handle needs MPI initialized by the caller (it made the communicator).
  int64_t fortran_comm = -1;
};

// Initializes MPI if it is not yet (see above) and makes a communicator over
// a duplicate of MPI_COMM_WORLD (or of options.fortran_comm). Collective over
// all ranks of that communicator (every rank must call it, in the same order
// as its other communicators).
// `device` must be a host backend and outlive the communicator. Destroy the
// communicator only once no collective of it is queued (synchronize the
// streams first). Errors: kInvalidArgument (null or CUDA device, timeout <= 0),
// kUnavailable (MPI already finalized, init failed, thread level too low),
// kInvalidArgument (a handle MPI does not know, or given before MPI_Init).
Result<std::unique_ptr<Communicator>> create_mpi_communicator(DeviceBackend* device, const MpiCommOptions& options);

// Rank 0's blob to every rank of options' communicator (collective over its
// ranks, like create_mpi_communicator): rank 0 calls `make` (only there)
// and every rank returns its blob, padded with zeros to `bytes` (the NCCL
// id under mpirun: communicator.h kNccl). A maker that fails on rank 0
// (run_blob_maker: an error, an exception, a blob longer than `bytes`) fails every rank at
// once, with its status code and "rank 0 could not make its blob: <why>":
// the others hear it instead of waiting out the timeout. Errors otherwise:
// create_mpi_communicator's, and the broadcast's (a rank that stopped
// participating: kUnavailable after options.timeout_s).
Result<std::vector<uint8_t>> mpi_broadcast_blob(const BlobMaker& make, std::size_t bytes,
                                                const MpiCommOptions& options);

// Calls MPI_Finalize if Strata initialized MPI and nobody finalized it yet
// (otherwise a no-op). If a communicator broke (a peer that timed out or a
// transport error), MPI_Finalize would wait for that peer forever: it calls
// MPI_Abort(MPI_COMM_WORLD, 1) instead, which ends this process with status 1
// and makes mpirun stop the job's other processes. Call after the last communicator is destroyed; if it
// is never called, it runs at exit. MPI cannot be initialized again after it.
void finalize_mpi();

}  // namespace strata::comm
