// test_comm_mpi's main: collectives_test.cpp over the MPI backend, under
// mpirun (MPI is initialized once per process).
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

#include "comm/mpi_comm.h"
#include "ranks_world.h"
#include "test_util/mpi_world.h"

namespace strata::comm {

World* g_world = nullptr;

Result<std::unique_ptr<Communicator>> make_communicator(DeviceBackend* dev, double timeout_s) {
  MpiCommOptions mo;
  mo.timeout_s = timeout_s;
  return create_mpi_communicator(dev, mo);
}

}  // namespace strata::comm

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  using namespace strata;
  strata::testing::MpiWorld mw;
  if (!strata::testing::open_mpi_world(&mw)) return 1;
  if (mw.comm->world_size() < 2) std::fprintf(stderr, "warning: 1 rank; run under mpirun -np 2 or more\n");
  comm::World world{std::move(mw.dev), std::move(mw.comm)};
  comm::g_world = &world;
  const int rc = RUN_ALL_TESTS();
  world.comm.reset();
  world.dev.reset();
  // MPI_Finalize itself, not comm::finalize_mpi(): the timeout test breaks a
  // communicator on purpose (which makes finalize_mpi() abort the job), and
  // its silent rank is alive, so finalizing completes here.
  MPI_Finalize();
  return rc;
}
