/* The engine's ranks through the C API, from a plain-C trainer that runs MPI
 * itself, under `mpirun -np 3`:
 *   - the trainer initializes MPI and splits MPI_COMM_WORLD into {0, 1} and
 *     {2}; each process creates its engine with STRATA_COMM_MPI over its part
 *     (mpi_comm = MPI_Comm_c2f(part)), so ranks 0-1 are one 2-rank job and
 *     rank 2 a 1-rank job: strata_engine_ranks says so (the handle is used,
 *     not MPI_COMM_WORLD);
 *   - for ZeRO stages 3 and 2, each rank trains 3 steps on gradients computed
 *     from the weights strata_engine_acquire gave it (its own micro-batch per
 *     step), and a 1-rank engine in the same process (STRATA_COMM_NONE) takes
 *     every rank's micro-batch of the job in rank order: the weights acquired
 *     and strata_engine_read_param (whole tensors, a collective) are
 *     bit-identical, and stats.comm_bytes is nonzero only with 2 ranks;
 *   - strata_engine_broadcast: the last rank's bytes reach every rank of the
 *     job (and the 1-rank engine's leaves its own); a root past the world
 *     size is refused, naming it;
 *   - refused by name: STRATA_COMM_MPI with STRATA_DEVICE_CUDA, NCCL with the
 *     host device, NCCL where no GPU is (unavailable), an unknown
 *     comm_kind, a handle MPI does not know, read_state with 2 ranks.
 * Exit status 0 = pass (every rank). */
#define _DEFAULT_SOURCE
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c_check.h"
#include "strata/strata.h"

enum { NPARAM = 3, STEPS = 3 };
static const char* const kNames[NPARAM] = {"a.weight", "a.bias", "b.weight"};
static const char* const kGroups[NPARAM] = {"a", "a", "b"};
static const uint64_t kNumel[NPARAM] = {1031, 7, 2053}; /* none divides by 2 */

static float value(unsigned seed, unsigned i) {
  unsigned x = seed * 2654435761u ^ (i + 1) * 40503u;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return (float)(x % 20001) / 10000.0f - 1.0f;
}

static int create(strata_engine_t* e, int stage, strata_comm_kind_t kind, int64_t handle) {
  char cfg[512];
  snprintf(cfg, sizeof(cfg),
           "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.01, \"weight_decay\": 0.01}},"
           " \"zero_optimization\": {\"stage\": %d},"
           " \"strata\": {\"shard_alignment\": 256, \"device_memory\": \"64MiB\", \"device_reserve\": 0}}",
           stage);
  strata_engine_options_t o;
  strata_engine_options_init(&o);
  o.config_json = cfg;
  o.device_kind = STRATA_DEVICE_HOST;
  o.comm_kind = kind;
  o.mpi_comm = handle;
  o.comm_timeout_s = 60;
  strata_param_desc_t d[NPARAM];
  memset(d, 0, sizeof(d));
  for (int p = 0; p < NPARAM; ++p) {
    d[p].struct_size = sizeof(d[p]);
    d[p].name = kNames[p];
    d[p].group = kGroups[p];
    d[p].ndim = 1;
    d[p].shape[0] = kNumel[p];
    d[p].dtype = STRATA_DTYPE_BF16;
  }
  OK(NULL, strata_engine_create(&o, d, NPARAM, e));
  for (int p = 0; p < NPARAM; ++p) {
    float* w = malloc(kNumel[p] * sizeof(float));
    for (unsigned i = 0; i < kNumel[p]; ++i) w[i] = 0.3f * value(7 + p, i);
    strata_status_t rc = strata_engine_load_param(*e, p, w, STRATA_DTYPE_F32, kNumel[p]);
    free(w);
    OK(*e, rc);
  }
  return 0;
}

/* One micro-batch "of rank who": each group acquired, its weights appended to
 * seen (bf16 bits), gradients from them, reduced, released. */
static int micro_batch(strata_engine_t e, strata_stream_t s, int step, int who, int last, uint16_t* seen,
                       size_t* seen_n) {
  OK(e, strata_engine_begin_micro_batch(e, last));
  for (uint32_t g = 0; g < 2; ++g) {
    void* ptrs[2];
    size_t n = 0;
    OK(e, strata_engine_acquire(e, g, s, ptrs, 2, &n));
    OK(e, strata_stream_synchronize(s));
    const uint32_t first = g == 0 ? 0 : 2;
    for (size_t k = 0; k < n; ++k) {
      const uint32_t p = first + (uint32_t)k;
      const uint16_t* w = ptrs[k];
      float* grad = malloc(kNumel[p] * sizeof(float));
      for (unsigned i = 0; i < kNumel[p]; ++i) {
        uint32_t bits = (uint32_t)w[i] << 16;
        float wf;
        memcpy(&wf, &bits, 4);
        grad[i] = 0.5f * wf + value(1000u * step + 10u * who + p, i);
        if (seen) seen[(*seen_n)++] = w[i];
      }
      strata_status_t rc = strata_engine_reduce_grad(e, p, grad, STRATA_DTYPE_F32, s);
      if (rc == STRATA_OK) rc = strata_stream_synchronize(s); /* the gradient buffer is freed next */
      free(grad);
      OK(e, rc);
    }
    OK(e, strata_engine_release(e, g, s));
  }
  return 0;
}

static int run_stage(int stage, MPI_Comm part, int world_rank) {
  int rank = 0, size = 1;
  MPI_Comm_rank(part, &rank);
  MPI_Comm_size(part, &size);
  strata_engine_t multi = NULL, one = NULL;
  if (create(&multi, stage, STRATA_COMM_MPI, MPI_Comm_c2f(part)) != 0) return -1;
  if (create(&one, stage, STRATA_COMM_NONE, -1) != 0) return -1;
  uint32_t r = 99, w = 99;
  OK(multi, strata_engine_ranks(multi, &r, &w));
  CHECK(r == (uint32_t)rank && w == (uint32_t)size);
  OK(one, strata_engine_ranks(one, &r, &w));
  CHECK(r == 0 && w == 1);
  strata_stream_t sm = NULL, so = NULL;
  OK(multi, strata_stream_create(multi, "multi", &sm));
  OK(one, strata_stream_create(one, "one", &so));
  const size_t total = kNumel[0] + kNumel[1] + kNumel[2];
  uint16_t* mine = malloc(total * sizeof(uint16_t));
  uint16_t* want = malloc(total * sizeof(uint16_t));
  for (int step = 0; step < STEPS; ++step) {
    size_t nm = 0, nw = 0;
    if (micro_batch(multi, sm, step, rank, 1, mine, &nm) != 0) return -1;
    for (int m = 0; m < size; ++m)
      if (micro_batch(one, so, step, m, m == size - 1, m == 0 ? want : NULL, &nw) != 0) return -1;
    CHECK(nm == total && nw == total && memcmp(mine, want, total * sizeof(uint16_t)) == 0);
    strata_step_result_t a, b;
    memset(&a, 0, sizeof(a));
    memset(&b, 0, sizeof(b));
    a.struct_size = b.struct_size = sizeof(a);
    OK(multi, strata_engine_step(multi, -1, &a));
    OK(one, strata_engine_step(one, -1, &b));
    CHECK(a.step == b.step && !a.skipped);
  }
  for (int p = 0; p < NPARAM; ++p) {
    float* got = malloc(kNumel[p] * sizeof(float));
    float* ref = malloc(kNumel[p] * sizeof(float));
    strata_status_t rc = strata_engine_read_param(multi, p, got, STRATA_DTYPE_F32, kNumel[p]);
    if (rc == STRATA_OK) rc = strata_engine_read_param(one, p, ref, STRATA_DTYPE_F32, kNumel[p]);
    CHECK(rc == STRATA_OK);
    CHECK(rc == STRATA_OK && memcmp(got, ref, kNumel[p] * sizeof(float)) == 0);
    free(got);
    free(ref);
  }
  strata_engine_stats_t st;
  memset(&st, 0xAB, sizeof(st));
  st.struct_size = sizeof(st);
  OK(multi, strata_engine_stats(multi, &st));
  CHECK(size > 1 ? st.comm_bytes > 0 : st.comm_bytes == 0);
  /* Each group is acquired once per micro-batch and a step drops the slots:
   * stage 3 gathers every acquire (none ahead in this order, none reused). */
  CHECK(st.gathers_reused == 0);
  {
    /* 3 MB: several rounds of the engine's staging buffer. */
    const size_t n = 3u << 18;
    uint32_t* buf = malloc(n * sizeof(uint32_t));
    const int root = size - 1;
    for (size_t i = 0; i < n; ++i) buf[i] = (uint32_t)(rank * 1000003u + i);
    OK(multi, strata_engine_broadcast(multi, buf, n * sizeof(uint32_t), (uint32_t)root));
    int same = 1;
    for (size_t i = 0; i < n; ++i) same &= buf[i] == (uint32_t)(root * 1000003u + i);
    CHECK(same);
    OK(one, strata_engine_broadcast(one, buf, n * sizeof(uint32_t), 0));
    CHECK(buf[1] == (uint32_t)(root * 1000003u + 1));
    CHECK(strata_engine_broadcast(multi, buf, 4, (uint32_t)size) == STRATA_ERR_INVALID_ARGUMENT);
    CHECK(strstr(strata_engine_last_error(multi), "is not a rank") != NULL);
    free(buf);
  }
  if (size > 1) {
    float* dst = malloc(kNumel[0] * sizeof(float));
    CHECK(strata_engine_read_state(multi, 0, 0, dst, kNumel[0]) == STRATA_ERR_UNAVAILABLE);
    CHECK(strstr(strata_engine_last_error(multi), "N ranks") != NULL);
    free(dst);
  }
  free(mine);
  free(want);
  strata_stream_destroy(sm);
  strata_stream_destroy(so);
  strata_engine_destroy(multi);
  strata_engine_destroy(one);
  printf("rank %d (rank %d of %d in its job): stage %d matched the 1-rank engine\n", world_rank, rank, size, stage);
  return 0;
}

static int refusals(void) {
  strata_engine_options_t o;
  strata_engine_options_init(&o);
  CHECK(o.comm_kind == STRATA_COMM_NONE && o.mpi_comm == -1);
  strata_param_desc_t d;
  memset(&d, 0, sizeof(d));
  d.struct_size = sizeof(d);
  d.name = "w";
  d.group = "g";
  d.ndim = 1;
  d.shape[0] = 4;
  strata_engine_t e = NULL;
  o.comm_kind = STRATA_COMM_MPI;
  o.device_kind = STRATA_DEVICE_CUDA;
  CHECK(strata_engine_create(&o, &d, 1, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "STRATA_COMM_NCCL") != NULL);
  o.comm_kind = STRATA_COMM_NCCL;
  o.device_kind = STRATA_DEVICE_HOST;
  CHECK(strata_engine_create(&o, &d, 1, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "STRATA_COMM_MPI") != NULL);
  /* GPU ranks where there is no GPU (or no CUDA/NCCL build): unavailable, with the reason. */
  o.device_kind = STRATA_DEVICE_AUTO;
  CHECK(strata_engine_create(&o, &d, 1, &e) == STRATA_ERR_UNAVAILABLE);
  CHECK(strstr(strata_last_error(), "STRATA_COMM_NCCL") != NULL);
  o.device_kind = STRATA_DEVICE_HOST;
  o.comm_kind = (strata_comm_kind_t)7;
  CHECK(strata_engine_create(&o, &d, 1, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "comm_kind") != NULL);
  o.comm_kind = STRATA_COMM_MPI;
  o.mpi_comm = 123456;
  CHECK(strata_engine_create(&o, &d, 1, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "123456") != NULL);
  CHECK(e == NULL);
  return 0;
}

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int world_rank = 0, world_size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  MPI_Comm part;
  MPI_Comm_split(MPI_COMM_WORLD, world_rank < 2 ? 0 : 1, world_rank, &part);
  refusals();
  for (int stage = 3; stage >= 2; --stage)
    if (run_stage(stage, part, world_rank) != 0) break;
  MPI_Comm_free(&part);
  /* Every rank's verdict: one rank's failure fails the job's status on all. */
  int mine = failures, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Finalize();
  if (all && !failures) fprintf(stderr, "rank %d: another rank failed\n", world_rank);
  failures += all && !failures;
  return check_summary("engine ranks through the C API");
}
