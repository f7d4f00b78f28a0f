/* The offload engine driven from plain C (C11) as a trainer written in C
 * would, on the host backend: a 3-group toy MLP whose gradients are computed
 * here, trained with
 *   run A: every state in RAM, checked after each step against a reference
 *          AdamW written here in double (tolerance: 2e-5 absolute + 2e-5
 *          relative, float vs double rounding over a few steps);
 *   run B: parameters, gradients and optimizer states on NVMe (a temp dir):
 *          bit-identical to run A;
 *   run C: run B's checkpoint after step 3 loaded into a new engine and
 *          continued: bit-identical to run B, extra state round-tripped;
 * and every error path a C caller meets (NULL handles, bad struct_size,
 * malformed or wrong config, unknown names, bad ids, wrong counts).
 * Exit status 0 = pass. Temp files: STRATA_TEST_DIR or /tmp, removed. */
#define _XOPEN_SOURCE 700
#define _DEFAULT_SOURCE
#include <arpa/inet.h>
#include <ftw.h>
#include <math.h>
#include <netinet/in.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "c_check.h"
#include "strata/strata.h"

/* ------------------------------------------------------------------ the model
 * x[6] -> h1 = tanh(W0 x + b0)[4] -> h2 = tanh(W1 h1 + b1)[3] -> y = W2 h2 [2]
 * loss = 1/(2B) sum_b |y_b - t_b|^2. Groups: "layer0" (W0, b0), "layer1"
 * (W1, b1), "head" (W2). */
enum { IN = 6, H1 = 4, H2 = 3, OUT = 2, BATCH = 5, NPARAM = 5, NGROUP = 3, STEPS = 5 };
static const char* const kNames[NPARAM] = {"layer0.weight", "layer0.bias", "layer1.weight", "layer1.bias",
                                           "head.weight"};
static const char* const kGroups[NPARAM] = {"layer0", "layer0", "layer1", "layer1", "head"};
static const uint64_t kRows[NPARAM] = {H1, H1, H2, H2, OUT};
static const uint64_t kCols[NPARAM] = {IN, 0, H1, 0, H2}; /* 0: a vector */
static size_t numel(int p) { return (size_t)kRows[p] * (kCols[p] ? kCols[p] : 1); }

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* A loopback port nothing listened on a moment ago (the kernel's pick). */
static int free_port(void) {
  struct sockaddr_in a;
  socklen_t len = sizeof a;
  memset(&a, 0, sizeof a);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  CHECK(fd >= 0);
  CHECK(bind(fd, (struct sockaddr*)&a, sizeof a) == 0);
  CHECK(getsockname(fd, (struct sockaddr*)&a, &len) == 0);
  close(fd);
  return ntohs(a.sin_port);
}

static const double kLr = 0.01, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8, kWd = 0.01;

static unsigned lcg(unsigned* s) {
  *s = *s * 1103515245u + 12345u;
  return *s >> 8;
}
static float uniform(unsigned* s) { return (float)(lcg(s) % 20001) / 10000.0f - 1.0f; }

static void init_params(float* params[NPARAM]) {
  unsigned seed = 7;
  for (int p = 0; p < NPARAM; ++p)
    for (size_t i = 0; i < numel(p); ++i) params[p][i] = 0.5f * uniform(&seed);
}

/* The batch of step `step` (deterministic, so every run sees the same data). */
static void batch(int step, float x[BATCH][IN], float t[BATCH][OUT]) {
  unsigned seed = 1000u + (unsigned)step;
  for (int b = 0; b < BATCH; ++b) {
    for (int i = 0; i < IN; ++i) x[b][i] = uniform(&seed);
    for (int o = 0; o < OUT; ++o) t[b][o] = uniform(&seed);
  }
}

/* Gradients of the loss at params (float, as a trainer would compute them). */
static void gradients(float* const w[NPARAM], int step, float* g[NPARAM]) {
  float x[BATCH][IN], t[BATCH][OUT];
  batch(step, x, t);
  for (int p = 0; p < NPARAM; ++p) memset(g[p], 0, numel(p) * sizeof(float));
  for (int b = 0; b < BATCH; ++b) {
    float h1[H1], h2[H2], y[OUT], dy[OUT], dh2[H2], dh1[H1];
    for (int j = 0; j < H1; ++j) {
      float a = w[1][j];
      for (int i = 0; i < IN; ++i) a += w[0][j * IN + i] * x[b][i];
      h1[j] = tanhf(a);
    }
    for (int k = 0; k < H2; ++k) {
      float a = w[3][k];
      for (int j = 0; j < H1; ++j) a += w[2][k * H1 + j] * h1[j];
      h2[k] = tanhf(a);
    }
    for (int o = 0; o < OUT; ++o) {
      float a = 0;
      for (int k = 0; k < H2; ++k) a += w[4][o * H2 + k] * h2[k];
      y[o] = a;
      dy[o] = (y[o] - t[b][o]) / BATCH;
    }
    for (int k = 0; k < H2; ++k) {
      float a = 0;
      for (int o = 0; o < OUT; ++o) {
        g[4][o * H2 + k] += dy[o] * h2[k];
        a += w[4][o * H2 + k] * dy[o];
      }
      dh2[k] = a * (1 - h2[k] * h2[k]);
    }
    for (int j = 0; j < H1; ++j) {
      float a = 0;
      for (int k = 0; k < H2; ++k) {
        g[2][k * H1 + j] += dh2[k] * h1[j];
        a += w[2][k * H1 + j] * dh2[k];
      }
      dh1[j] = a * (1 - h1[j] * h1[j]);
    }
    for (int k = 0; k < H2; ++k) g[3][k] += dh2[k];
    for (int j = 0; j < H1; ++j) {
      g[1][j] += dh1[j];
      for (int i = 0; i < IN; ++i) g[0][j * IN + i] += dh1[j] * x[b][i];
    }
  }
}

/* torch.optim.AdamW in double. */
typedef struct {
  double* p[NPARAM];
  double* m[NPARAM];
  double* v[NPARAM];
} Reference;

static void reference_step(Reference* r, float* const g[NPARAM], int t) {
  const double bc1 = 1 - pow(kBeta1, t), bc2 = 1 - pow(kBeta2, t);
  for (int p = 0; p < NPARAM; ++p)
    for (size_t i = 0; i < numel(p); ++i) {
      double gi = g[p][i];
      r->p[p][i] *= 1 - kLr * kWd;
      r->m[p][i] = kBeta1 * r->m[p][i] + (1 - kBeta1) * gi;
      r->v[p][i] = kBeta2 * r->v[p][i] + (1 - kBeta2) * gi * gi;
      r->p[p][i] -= (kLr / bc1) * r->m[p][i] / (sqrt(r->v[p][i]) / sqrt(bc2) + kEps);
    }
}

/* ------------------------------------------------------------------ helpers */

static char g_tmp[4096];

static int rm_entry(const char* path, const struct stat* sb, int flag, struct FTW* ftw) {
  (void)sb, (void)flag, (void)ftw;
  return remove(path);
}
static void rm_tree(const char* path) { nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

static int file_contains(const char* path, const char* needle) {
  FILE* f = fopen(path, "rb");
  if (!f) return 0;
  static char buf[1 << 20];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  return strstr(buf, needle) != NULL;
}

static void describe(strata_param_desc_t d[NPARAM]) {
  memset(d, 0, NPARAM * sizeof(*d));
  for (int p = 0; p < NPARAM; ++p) {
    d[p].struct_size = sizeof(d[p]);
    d[p].name = kNames[p];
    d[p].group = kGroups[p];
    d[p].ndim = kCols[p] ? 2 : 1;
    d[p].shape[0] = kRows[p];
    d[p].shape[1] = kCols[p];
    d[p].dtype = STRATA_DTYPE_F32;
  }
}

/* RAM: host tiers. NVMe: parameters, gradients and states in `nvme_dir`. */
static void make_config(char* out, size_t len, int nvme, const char* nvme_dir, const char* trace) {
  char zero[1024], extra[1024];
  if (nvme)
    snprintf(zero, sizeof(zero),
             "\"offload_param\": {\"device\": \"nvme\", \"nvme_path\": \"%s\", \"buffer_count\": 4,"
             " \"buffer_size\": 65536},"
             "\"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"%s\", \"buffer_count\": 4,"
             " \"pipeline_read\": true, \"pipeline_write\": true}",
             nvme_dir, nvme_dir);
  else
    snprintf(zero, sizeof(zero),
             "\"offload_param\": {\"device\": \"cpu\", \"buffer_count\": 4, \"buffer_size\": 65536},"
             "\"offload_optimizer\": {\"device\": \"cpu\"}");
  snprintf(extra, sizeof(extra), "%s%s%s%s", nvme ? ", \"groups\": [{\"match\": \"*\", \"grad\": \"nvme\"}]" : "",
           trace ? ", \"trace\": \"" : "", trace ? trace : "", trace ? "\"" : "");
  snprintf(out, len,
           "{\"zero_optimization\": {\"stage\": 3, %s},\n"
           " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": %g, \"betas\": [%g, %g], \"eps\": %g,"
           " \"weight_decay\": %g}},\n"
           " \"gradient_accumulation_steps\": 1,\n"
           " \"strata\": {\"device_memory\": \"64MiB\", \"device_reserve\": 0, \"optimizer_chunk\": 4096%s}}",
           zero, kLr, kBeta1, kBeta2, kEps, kWd, extra);
}

static int create_engine(int nvme, const char* nvme_dir, const char* trace, strata_engine_t* e) {
  char cfg[4096];
  make_config(cfg, sizeof(cfg), nvme, nvme_dir, trace);
  strata_engine_options_t opts;
  OK(NULL, strata_engine_options_init(&opts));
  opts.config_json = cfg;
  opts.device_kind = STRATA_DEVICE_HOST;
  strata_param_desc_t d[NPARAM];
  describe(d);
  OK(NULL, strata_engine_create(&opts, d, NPARAM, e));
  return 0;
}

/* A run's buffers: host copies of the parameters and gradients, device
 * gradient buffers, one stream. */
typedef struct {
  strata_engine_t e;
  strata_stream_t s;
  uint32_t ids[NPARAM];  /* engine ids of kNames */
  uint32_t groups[NGROUP];
  float* w[NPARAM];
  float* g[NPARAM];
  void* dev_g[NPARAM];
} Run;

static int run_open(Run* r, strata_engine_t e) {
  memset(r, 0, sizeof(*r));
  r->e = e;
  OK(e, strata_stream_create(e, "trainer", &r->s));
  for (int p = 0; p < NPARAM; ++p) {
    OK(e, strata_engine_find_param(e, kNames[p], &r->ids[p]));
    r->w[p] = malloc(numel(p) * sizeof(float));
    r->g[p] = malloc(numel(p) * sizeof(float));
    OK(e, strata_device_alloc(e, numel(p) * sizeof(float), &r->dev_g[p]));
  }
  OK(e, strata_engine_find_group(e, "layer0", &r->groups[0]));
  OK(e, strata_engine_find_group(e, "layer1", &r->groups[1]));
  OK(e, strata_engine_find_group(e, "head", &r->groups[2]));
  return 0;
}

static void run_close(Run* r) {
  for (int p = 0; p < NPARAM; ++p) {
    if (r->dev_g[p]) CHECK(strata_device_free(r->e, r->dev_g[p], NULL) == STRATA_OK);
    free(r->w[p]);
    free(r->g[p]);
  }
  CHECK(strata_stream_destroy(r->s) == STRATA_OK);
  strata_engine_destroy(r->e);
}

/* Which model parameter (index into kNames) an engine id is. */
static int model_index(const Run* r, uint32_t id) {
  for (int p = 0; p < NPARAM; ++p)
    if (r->ids[p] == id) return p;
  return -1;
}

/* One optimizer step of the protocol: forward acquires (copying the values
 * to the host), gradients computed here, backward acquires with reduce_grad,
 * step. */
static int train_step(Run* r, int step, strata_step_result_t* res) {
  strata_engine_t e = r->e;
  void* ptrs[4];
  size_t n = 0;
  OK(e, strata_engine_begin_micro_batch(e, 1));
  OK(e, strata_engine_trace_begin(e, "forward"));
  for (int k = 0; k < NGROUP; ++k) {
    uint32_t ids[4];
    size_t m = 0;
    OK(e, strata_engine_group_params(e, r->groups[k], ids, 4, &m));
    OK(e, strata_engine_acquire(e, r->groups[k], r->s, ptrs, 4, &n));
    CHECK(n == m);
    for (size_t i = 0; i < n; ++i) {
      int p = model_index(r, ids[i]);
      CHECK(p >= 0);
      if (p < 0) return -1;
      OK(e, strata_memcpy_async(r->w[p], ptrs[i], numel(p) * sizeof(float), STRATA_COPY_DEVICE_TO_HOST, r->s));
    }
    OK(e, strata_engine_release(e, r->groups[k], r->s));
  }
  OK(e, strata_stream_synchronize(r->s));
  OK(e, strata_engine_trace_end(e));
  gradients(r->w, step, r->g);
  for (int k = NGROUP - 1; k >= 0; --k) {
    uint32_t ids[4];
    size_t m = 0;
    OK(e, strata_engine_group_params(e, r->groups[k], ids, 4, &m));
    OK(e, strata_engine_acquire(e, r->groups[k], r->s, ptrs, 4, &n));
    for (size_t i = 0; i < m; ++i) {
      int p = model_index(r, ids[i]);
      OK(e, strata_memcpy_async(r->dev_g[p], r->g[p], numel(p) * sizeof(float), STRATA_COPY_HOST_TO_DEVICE, r->s));
      OK(e, strata_engine_reduce_grad(e, ids[i], r->dev_g[p], STRATA_DTYPE_F32, r->s));
    }
    OK(e, strata_engine_release(e, r->groups[k], r->s));
  }
  OK(e, strata_stream_synchronize(r->s));
  memset(res, 0, sizeof(*res));
  res->struct_size = sizeof(*res);
  OK(e, strata_engine_step(e, -1, res));
  OK(e, strata_engine_synchronize(e));
  return 0;
}

static int read_all(Run* r, float* out[NPARAM]) {
  for (int p = 0; p < NPARAM; ++p)
    OK(r->e, strata_engine_read_param(r->e, r->ids[p], out[p], STRATA_DTYPE_F32, numel(p)));
  return 0;
}

static void alloc_set(float* s[NPARAM]) {
  for (int p = 0; p < NPARAM; ++p) s[p] = calloc(numel(p), sizeof(float));
}
static void free_set(float* s[NPARAM]) {
  for (int p = 0; p < NPARAM; ++p) free(s[p]);
}
static int same_bits(float* const a[NPARAM], float* const b[NPARAM]) {
  for (int p = 0; p < NPARAM; ++p)
    if (memcmp(a[p], b[p], numel(p) * sizeof(float)) != 0) return 0;
  return 1;
}

/* ------------------------------------------------------------------ run A: RAM vs the reference */

static float* g_final_ram[NPARAM];

static int test_ram_matches_reference(void) {
  char trace[4200];
  snprintf(trace, sizeof(trace), "%s/trace.json", g_tmp);
  strata_engine_t e = NULL;
  if (create_engine(0, NULL, trace, &e) != 0) return -1;

  strata_device_kind_t kind;
  const char* dev_name = NULL;
  OK(e, strata_engine_device(e, &kind, &dev_name));
  CHECK(kind == STRATA_DEVICE_HOST);
  CHECK(dev_name && strlen(dev_name) > 0);
  uint32_t np = 0, ng = 0;
  OK(e, strata_engine_param_count(e, &np));
  OK(e, strata_engine_group_count(e, &ng));
  CHECK(np == NPARAM && ng == NGROUP);
  strata_param_info_t pi;
  memset(&pi, 0, sizeof(pi));
  pi.struct_size = sizeof(pi);
  uint32_t w1;
  OK(e, strata_engine_find_param(e, "layer1.weight", &w1));
  OK(e, strata_engine_param_info(e, w1, &pi));
  CHECK(strcmp(pi.name, "layer1.weight") == 0 && strcmp(pi.group, "layer1") == 0);
  CHECK(pi.ndim == 2 && pi.shape[0] == H2 && pi.shape[1] == H1 && pi.shape[2] == 0 && pi.numel == H2 * H1);
  CHECK(pi.dtype == STRATA_DTYPE_F32);
  strata_group_info_t gi;
  memset(&gi, 0, sizeof(gi));
  gi.struct_size = sizeof(gi);
  OK(e, strata_engine_group_info(e, pi.group_id, &gi));
  CHECK(strcmp(gi.name, "layer1") == 0 && gi.param_count == 2 && gi.numel == H2 * H1 + H2);
  CHECK(gi.tier[STRATA_STATE_MASTER] == STRATA_TIER_HOST);
  CHECK(gi.tier[STRATA_STATE_OPTIMIZER] == STRATA_TIER_HOST);
  char* report = NULL;
  OK(e, strata_engine_plan_report(e, &report));
  CHECK(report && strstr(report, "Plan:") != NULL && strstr(report, "3 groups") != NULL);
  strata_free(report);

  Run r;
  if (run_open(&r, e) != 0) return -1;
  float* init[NPARAM];
  alloc_set(init);
  init_params(init);
  Reference ref;
  for (int p = 0; p < NPARAM; ++p) {
    OK(e, strata_engine_load_param(e, r.ids[p], init[p], STRATA_DTYPE_F32, numel(p)));
    ref.p[p] = malloc(numel(p) * sizeof(double));
    ref.m[p] = calloc(numel(p), sizeof(double));
    ref.v[p] = calloc(numel(p), sizeof(double));
    for (size_t i = 0; i < numel(p); ++i) ref.p[p][i] = init[p][i];
  }
  float* got[NPARAM];
  alloc_set(got);
  if (read_all(&r, got) != 0) return -1;
  CHECK(same_bits(got, init)); /* fp32 master round-trips exactly */

  double max_err = 0;
  for (int step = 1; step <= STEPS; ++step) {
    strata_step_result_t res;
    if (train_step(&r, step, &res) != 0) return -1;
    /* The gradients were computed from the values acquire() gave: they must
     * be the reference's parameters of this step (rounded to float). */
    double sq = 0;
    for (int p = 0; p < NPARAM; ++p)
      for (size_t i = 0; i < numel(p); ++i) sq += (double)r.g[p][i] * r.g[p][i];
    reference_step(&ref, r.g, step);
    CHECK(res.step == step);
    CHECK(!res.skipped);
    CHECK(fabs(res.grad_norm - sqrt(sq)) <= 1e-6 * sqrt(sq) + 1e-12);
    CHECK(res.clip_coef == 1.0);
    CHECK(fabs(res.lr - kLr) < 1e-12);
    if (read_all(&r, got) != 0) return -1;
    for (int p = 0; p < NPARAM; ++p)
      for (size_t i = 0; i < numel(p); ++i) {
        double err = fabs(got[p][i] - ref.p[p][i]);
        if (err > max_err) max_err = err;
        if (err > 2e-5 + 2e-5 * fabs(ref.p[p][i])) {
          fprintf(stderr, "step %d %s[%zu]: engine %.9g reference %.9g\n", step, kNames[p], i, got[p][i],
                  ref.p[p][i]);
          ++failures;
          return -1;
        }
      }
  }
  printf("run A (RAM): %d steps, max |engine - reference AdamW| = %.3g\n", STEPS, max_err);
  /* The moments, as the reference AdamW keeps them (torch's exp_avg, exp_avg_sq). */
  for (int p = 0; p < NPARAM; ++p) {
    float* mv = malloc(numel(p) * sizeof(float));
    OK(e, strata_engine_read_state(e, r.ids[p], 0, mv, numel(p)));
    for (size_t i = 0; i < numel(p); ++i) CHECK(fabs(mv[i] - ref.m[p][i]) <= 1e-6 + 1e-4 * fabs(ref.m[p][i]));
    OK(e, strata_engine_read_state(e, r.ids[p], 1, mv, numel(p)));
    for (size_t i = 0; i < numel(p); ++i) CHECK(fabs(mv[i] - ref.v[p][i]) <= 1e-9 + 1e-4 * fabs(ref.v[p][i]));
    CHECK(strata_engine_read_state(e, r.ids[p], 2, mv, numel(p)) == STRATA_ERR_INVALID_ARGUMENT);
    CHECK(strata_engine_read_state(e, r.ids[p], 0, mv, numel(p) + 1) == STRATA_ERR_INVALID_ARGUMENT);
    free(mv);
  }
  CHECK(strata_engine_set_lr(e, -1.0) == STRATA_ERR_INVALID_ARGUMENT);
  OK(e, strata_engine_set_lr(e, kLr));
  int64_t steps = 0;
  OK(e, strata_engine_step_count(e, &steps));
  CHECK(steps == STEPS);
  double scale = 0;
  OK(e, strata_engine_loss_scale(e, &scale));
  CHECK(scale == 1.0);
  strata_engine_stats_t st;
  memset(&st, 0, sizeof(st));
  st.struct_size = sizeof(st);
  OK(e, strata_engine_stats(e, &st));
  CHECK(st.steps == STEPS && st.skipped_steps == 0);
  CHECK(st.acquires == (uint64_t)(2 * NGROUP * STEPS));
  CHECK(st.tier_bytes[STRATA_TIER_NVME] == 0 && st.tier_bytes[STRATA_TIER_HOST] > 0);
  CHECK(st.gathers_ahead == 0 && st.gathers_reused == 0); /* one rank: nothing gathered */
  /* A caller built against API 7 (no gathers_reused): that field is left alone. */
  memset(&st, 0xAB, sizeof(st));
  st.struct_size = offsetof(strata_engine_stats_t, gathers_reused);
  OK(e, strata_engine_stats(e, &st));
  CHECK(st.steps == STEPS && st.gathers_ahead == 0);
  CHECK(st.gathers_reused == 0xABABABABABABABABull); /* untouched */
  /* A caller built against API 6 (no gathers_ahead): accepted, and the bytes
   * past its struct_size are left alone; one field short of that is refused. */
  memset(&st, 0xAB, sizeof(st));
  st.struct_size = offsetof(strata_engine_stats_t, gathers_ahead);
  OK(e, strata_engine_stats(e, &st));
  CHECK(st.steps == STEPS && st.comm_bytes == 0);
  CHECK(st.gathers_ahead == 0xABABABABABABABABull && st.gathers_reused == 0xABABABABABABABABull); /* untouched */
  st.struct_size = offsetof(strata_engine_stats_t, comm_bytes);
  CHECK(strata_engine_stats(e, &st) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_engine_last_error(e), "struct_size") != NULL);

  alloc_set(g_final_ram);
  if (read_all(&r, g_final_ram) != 0) return -1;
  run_close(&r); /* closes the trace */
  CHECK(file_contains(trace, "\"forward\""));
  for (int p = 0; p < NPARAM; ++p) {
    free(ref.p[p]);
    free(ref.m[p]);
    free(ref.v[p]);
  }
  free_set(init);
  free_set(got);
  return 0;
}

/* ------------------------------------------------------------------ runs B and C: NVMe, checkpoint */

static int test_nvme_and_checkpoint(void) {
  char nvme_b[4200], nvme_c[4200], ckpt[4200];
  snprintf(nvme_b, sizeof(nvme_b), "%s/nvme_b", g_tmp);
  snprintf(nvme_c, sizeof(nvme_c), "%s/nvme_c", g_tmp);
  snprintf(ckpt, sizeof(ckpt), "%s/ckpt", g_tmp);
  CHECK(mkdir(nvme_b, 0755) == 0 && mkdir(nvme_c, 0755) == 0);

  strata_engine_t e = NULL;
  if (create_engine(1, nvme_b, NULL, &e) != 0) return -1;
  Run r;
  if (run_open(&r, e) != 0) return -1;
  strata_group_info_t gi;
  memset(&gi, 0, sizeof(gi));
  gi.struct_size = sizeof(gi);
  OK(e, strata_engine_group_info(e, r.groups[0], &gi));
  CHECK(gi.tier[STRATA_STATE_OPTIMIZER] == STRATA_TIER_NVME);
  CHECK(gi.tier[STRATA_STATE_MASTER] == STRATA_TIER_NVME);
  CHECK(gi.tier[STRATA_STATE_GRAD] == STRATA_TIER_NVME);

  float* init[NPARAM];
  alloc_set(init);
  init_params(init);
  for (int p = 0; p < NPARAM; ++p) OK(e, strata_engine_load_param(e, r.ids[p], init[p], STRATA_DTYPE_F32, numel(p)));
  strata_step_result_t res;
  for (int step = 1; step <= 3; ++step)
    if (train_step(&r, step, &res) != 0) return -1;
  OK(e, strata_engine_save_checkpoint(e, ckpt, "{\"data_position\": 3}"));
  for (int step = 4; step <= STEPS; ++step)
    if (train_step(&r, step, &res) != 0) return -1;
  float* final_b[NPARAM];
  alloc_set(final_b);
  if (read_all(&r, final_b) != 0) return -1;
  CHECK(same_bits(final_b, g_final_ram)); /* placement never changes results */
  strata_engine_stats_t st;
  memset(&st, 0, sizeof(st));
  st.struct_size = sizeof(st);
  OK(e, strata_engine_stats(e, &st));
  CHECK(st.tier_bytes[STRATA_TIER_NVME] > 0);
  CHECK(st.nvme_read_bytes > 0 && st.nvme_write_bytes > 0);
  run_close(&r);

  /* Run C: a new engine, state from the checkpoint, continued. */
  if (create_engine(1, nvme_c, NULL, &e) != 0) return -1;
  if (run_open(&r, e) != 0) return -1;
  char* extra = NULL;
  OK(e, strata_engine_load_checkpoint(e, ckpt, &extra));
  CHECK(extra && strstr(extra, "data_position") != NULL && strstr(extra, "3") != NULL);
  strata_free(extra);
  int64_t steps = 0;
  OK(e, strata_engine_step_count(e, &steps));
  CHECK(steps == 3);
  for (int step = 4; step <= STEPS; ++step)
    if (train_step(&r, step, &res) != 0) return -1;
  CHECK(res.step == STEPS);
  float* final_c[NPARAM];
  alloc_set(final_c);
  if (read_all(&r, final_c) != 0) return -1;
  CHECK(same_bits(final_c, final_b));
  /* A damaged checkpoint is refused; the NULL extra pointer is fine. */
  char bogus[4200];
  snprintf(bogus, sizeof(bogus), "%s/no-such-checkpoint", g_tmp);
  CHECK(strata_engine_load_checkpoint(e, bogus, NULL) != STRATA_OK);
  CHECK(strstr(strata_engine_last_error(e), "no-such-checkpoint") != NULL);
  run_close(&r);
  printf("run B (NVMe) == run A bit for bit; run C (checkpoint at step 3, continued) == run B\n");
  free_set(init);
  free_set(final_b);
  free_set(final_c);
  return 0;
}

/* ------------------------------------------------------------------ errors a C caller meets */

static int test_errors(void) {
  strata_engine_options_t opts;
  strata_param_desc_t d[NPARAM];
  strata_engine_t e = NULL;
  describe(d);

  CHECK(strata_engine_options_init(NULL) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strata_engine_create(NULL, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "options") != NULL);

  /* struct_size: options, then a parameter. */
  OK(NULL, strata_engine_options_init(&opts));
  opts.device_kind = STRATA_DEVICE_HOST;
  opts.struct_size = 8;
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "struct_size") != NULL);
  /* One field short of API 6's struct (no comm_timeout_s): refused. */
  opts.struct_size = offsetof(strata_engine_options_t, comm_timeout_s);
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "struct_size") != NULL);
  /* API 6's struct (no nccl_comm; the bytes after it are garbage): accepted,
   * nccl_comm reads as NULL. */
  {
    union {
      strata_engine_options_t o;
      unsigned char b[sizeof(strata_engine_options_t)];
    } raw;
    memset(raw.b, 0xAB, sizeof(raw.b));
    strata_engine_options_t v6;
    OK(NULL, strata_engine_options_init(&v6));
    v6.device_kind = STRATA_DEVICE_HOST;
    v6.struct_size = offsetof(strata_engine_options_t, nccl_comm);
    memcpy(raw.b, &v6, v6.struct_size);
    OK(NULL, strata_engine_create(&raw.o, d, NPARAM, &e));
    strata_engine_destroy(e);
    e = NULL;
  }
  /* nccl_comm is for STRATA_COMM_NCCL only. */
  opts.struct_size = sizeof(opts);
  opts.nccl_comm = (void*)&opts;
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "nccl_comm") != NULL);
  opts.nccl_comm = NULL;
  /* STRATA_COMM_TCP (API 9): host ranks only, no MPI handle; with no
   * launcher in the environment, one rank (N ranks: test_torch_ranks.py
   * under torchrun). */
  opts.comm_kind = STRATA_COMM_TCP;
  opts.device_kind = STRATA_DEVICE_CUDA;
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "STRATA_COMM_TCP with STRATA_DEVICE_CUDA") != NULL);
  opts.device_kind = STRATA_DEVICE_HOST;
  opts.mpi_comm = 5;
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "options.mpi_comm") != NULL);
  opts.mpi_comm = -1;
  if (getenv("WORLD_SIZE") == NULL && getenv("OMPI_COMM_WORLD_SIZE") == NULL) {
    OK(NULL, strata_engine_create(&opts, d, NPARAM, &e));
    strata_engine_destroy(e);
    e = NULL;
  }
  /* Given ranks (API 10): checked by name; rank 0 of 1 needs no store (N
   * ranks: test_torch_ranks.py, a process group made by
   * torch.multiprocessing.spawn). */
  opts.comm_world_size = 2;
  opts.comm_rank = 2;
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "options.comm_rank 2 of options.comm_world_size 2") != NULL);
  opts.comm_rank = 1;
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "options.comm_store_addr '(null)' and options.comm_store_port 0") != NULL);
  opts.comm_store_addr = "127.0.0.1";
  opts.comm_store_port = 70000;
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "comm_store_port 70000") != NULL);
  opts.comm_kind = STRATA_COMM_MPI;
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "options.comm_world_size is 2 but options.comm_kind is 1") != NULL);
  opts.comm_kind = STRATA_COMM_TCP;
  /* A stop request (API 12) ends the wait for the other ranks at once,
   * instead of at the timeout: rank 1 whose store never answers, and rank 0
   * serving the store while rank 1 never comes. (The flag set by another
   * thread during the wait: TcpComm.AStopFlagEndsTheWaitForTheOtherRanks and
   * test_torch_ranks.py's Ctrl-C test.) */
  {
    volatile int stop = 1;
    opts.cancel = &stop;
    opts.comm_timeout_s = 120;
    opts.comm_store_addr = "127.0.0.1";
    opts.comm_store_port = free_port();
    for (int rank = 1; rank >= 0; --rank) {
      const double t0 = now_s();
      opts.comm_rank = rank;
      CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_CANCELLED);
      CHECK(strstr(strata_last_error(), "interrupted (a stop signal) while waiting") != NULL);
      CHECK(e == NULL);
      CHECK(now_s() - t0 < 30);
    }
    opts.cancel = NULL;
    opts.comm_timeout_s = 0;
  }
  opts.comm_world_size = 1;
  opts.comm_rank = 0;
  opts.comm_store_addr = NULL;
  opts.comm_store_port = 0;
  opts.comm_timeout_s = INFINITY; /* would overflow the clock's ticks */
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "options.comm_timeout_s is inf: seconds from 0 to 1e7") != NULL);
  opts.comm_timeout_s = 0;
  OK(NULL, strata_engine_create(&opts, d, NPARAM, &e));
  {
    uint32_t rank = 9, world = 9;
    OK(e, strata_engine_ranks(e, &rank, &world));
    CHECK(rank == 0 && world == 1);
  }
  strata_engine_destroy(e);
  e = NULL;
  opts.comm_world_size = 0;
  opts.comm_kind = STRATA_COMM_NONE;
  opts.struct_size = sizeof(opts);
  d[2].struct_size = 0;
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "params[2].struct_size") != NULL);
  describe(d);
  d[1].ndim = 9;
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "layer0.bias") != NULL);
  describe(d);
  d[3].name = "layer0.weight"; /* duplicate */
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "layer0.weight") != NULL);
  describe(d);
  /* An audit's crashes: lr_group UINT32_MAX wrapped a table's size to 0
   * (SIGSEGV at set_group_lr); a garbage stride read past the array; a name
   * that is not UTF-8 made every checkpoint save fail. */
  d[4].lr_group = 0xFFFFFFFFu;
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "head.weight's lr_group is 4294967295: at most 65536") != NULL);
  describe(d);
  for (int i = 0; i < NPARAM; ++i) d[i].struct_size = 1u << 20;
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "params[0].struct_size is 1048576, more than 4096") != NULL);
  describe(d);
  d[1].name = "layer0.\xff";
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "parameter name \"layer0.\\xff\" is not valid UTF-8") != NULL);
  describe(d);
  d[1].group = "\xed\xa0\x80"; /* a surrogate */
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "group name \"\\xed\\xa0\\x80\" is not valid UTF-8") != NULL);
  describe(d);
  CHECK(strata_engine_create(&opts, d, 0, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(e == NULL);

  /* Malformed JSON: the message gives the position. */
  opts.config_json = "{\n  \"optimizer\": {\"type\": \"AdamW\",,}\n}";
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "<config_json>") != NULL);
  CHECK(strstr(strata_last_error(), "line 2") != NULL);
  CHECK(strstr(strata_last_error(), "byte") != NULL);
  /* A key Strata does not know: named with its path. */
  opts.config_json = "{\"zero_optimization\": {\"offload_optimizer\": {\"devise\": \"cpu\"}}}";
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "zero_optimization.offload_optimizer.devise") != NULL);
  opts.config_json = "{}";
  opts.config_path = "/nonexistent/strata.json";
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_INVALID_ARGUMENT); /* both set */
  opts.config_json = NULL;
  CHECK(strata_engine_create(&opts, d, NPARAM, &e) == STRATA_ERR_NOT_FOUND);
  CHECK(strstr(strata_last_error(), "/nonexistent/strata.json") != NULL);
  CHECK(e == NULL);

  /* NULL handles. */
  CHECK(strata_engine_step(NULL, -1, NULL) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strata_engine_synchronize(NULL) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_last_error(), "engine is NULL") != NULL);
  CHECK(strata_stream_synchronize(NULL) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strcmp(strata_engine_last_error(NULL), "") == 0);
  CHECK(strata_stream_destroy(NULL) == STRATA_OK);
  strata_engine_destroy(NULL);

  /* On a live engine. */
  if (create_engine(0, NULL, NULL, &e) != 0) return -1;
  CHECK(strcmp(strata_engine_last_error(e), "") == 0);
  uint32_t id = 0;
  CHECK(strata_engine_find_param(e, "no.such.param", &id) == STRATA_ERR_NOT_FOUND);
  CHECK(strstr(strata_engine_last_error(e), "no.such.param") != NULL);
  CHECK(strata_engine_find_group(e, "layer7", &id) == STRATA_ERR_NOT_FOUND);
  CHECK(strstr(strata_engine_last_error(e), "layer7") != NULL);
  strata_param_info_t pi;
  memset(&pi, 0, sizeof(pi));
  CHECK(strata_engine_param_info(e, 0, &pi) == STRATA_ERR_INVALID_ARGUMENT); /* struct_size 0 */
  CHECK(strstr(strata_engine_last_error(e), "struct_size") != NULL);
  pi.struct_size = sizeof(pi);
  CHECK(strata_engine_param_info(e, NPARAM, &pi) == STRATA_ERR_INVALID_ARGUMENT);

  strata_stream_t s = NULL;
  OK(e, strata_stream_create(e, "errors", &s));
  strata_stream_t wrapped = NULL;
  CHECK(strata_stream_wrap(e, NULL, &wrapped) == STRATA_ERR_INVALID_ARGUMENT); /* host: no native streams */
  CHECK(strstr(strata_engine_last_error(e), "native") != NULL);
  CHECK(wrapped == NULL);

  void* ptrs[4];
  size_t n = 99;
  OK(e, strata_engine_begin_micro_batch(e, 1));
  CHECK(strata_engine_acquire(e, NGROUP, s, ptrs, 4, &n) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_engine_last_error(e), "group id 3") != NULL);
  CHECK(strata_engine_acquire(e, 0xFFFFFFFFu, s, ptrs, 4, &n) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strata_engine_acquire(e, 0, NULL, ptrs, 4, &n) == STRATA_ERR_INVALID_ARGUMENT);
  uint32_t g0;
  OK(e, strata_engine_find_group(e, "layer0", &g0));
  CHECK(strata_engine_acquire(e, g0, s, ptrs, 1, &n) == STRATA_ERR_INVALID_ARGUMENT); /* capacity */
  CHECK(strstr(strata_engine_last_error(e), "capacity") != NULL);
  CHECK(n == 99);
  /* Nothing was acquired by the failed calls: this one works. */
  OK(e, strata_engine_acquire(e, g0, s, ptrs, 4, &n));
  CHECK(n == 2);
  OK(e, strata_engine_release(e, g0, s));
  OK(e, strata_stream_synchronize(s));
  /* An abandoned step (an exception in forward): a group still held is
   * released by discard_step, which needs the stream for that. */
  OK(e, strata_engine_acquire(e, g0, s, ptrs, 4, &n));
  CHECK(strata_engine_discard_step(e, NULL) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_engine_last_error(e), "stream") != NULL);
  OK(e, strata_engine_discard_step(e, s));
  OK(e, strata_engine_acquire(e, g0, s, ptrs, 4, &n)); /* released: acquirable again */
  OK(e, strata_engine_release(e, g0, s));
  OK(e, strata_engine_discard_step(e, NULL));
  OK(e, strata_stream_synchronize(s));

  uint32_t w0;
  OK(e, strata_engine_find_param(e, "layer0.weight", &w0));
  float buf[H1 * IN] = {0};
  CHECK(strata_engine_load_param(e, w0, buf, STRATA_DTYPE_F32, 3) == STRATA_ERR_INVALID_ARGUMENT); /* count */
  CHECK(strstr(strata_engine_last_error(e), "layer0.weight") != NULL);
  CHECK(strata_engine_load_param(e, w0, buf, (strata_dtype_t)7, H1 * IN) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strata_engine_read_param(e, w0, NULL, STRATA_DTYPE_F32, H1 * IN) == STRATA_ERR_INVALID_ARGUMENT);

  strata_step_result_t res;
  memset(&res, 0, sizeof(res));
  res.struct_size = 4;
  CHECK(strata_engine_step(e, -1, &res) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_engine_last_error(e), "result.struct_size") != NULL);
  /* A non-finite lr is refused before the step runs (it was taken, and the
   * background update then broke the engine). */
  CHECK(strata_engine_step(e, INFINITY, NULL) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_engine_last_error(e), "the lr must be finite") != NULL);
  CHECK(strata_engine_step(e, NAN, NULL) == STRATA_ERR_INVALID_ARGUMENT);
  OK(e, strata_engine_synchronize(e));
  int64_t steps = -1;
  OK(e, strata_engine_step_count(e, &steps));
  CHECK(steps == 0); /* refused before the step ran */
  strata_engine_stats_t st;
  memset(&st, 0, sizeof(st));
  CHECK(strata_engine_stats(e, &st) == STRATA_ERR_INVALID_ARGUMENT);

  void* dev = NULL;
  OK(e, strata_device_alloc(e, 256, &dev));
  CHECK(strata_memcpy_async(dev, buf, 256, (strata_copy_kind_t)9, s) == STRATA_ERR_INVALID_ARGUMENT);
  OK(e, strata_device_free(e, dev, s));
  CHECK(strata_engine_save_checkpoint(e, NULL, NULL) == STRATA_ERR_INVALID_ARGUMENT);

  /* Destroying the engine first leaves the stream handle dead, not dangling. */
  strata_engine_destroy(e);
  CHECK(strata_stream_synchronize(s) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strata_stream_destroy(s) == STRATA_OK);
  return 0;
}

int main(void) {
  const char* base = getenv("STRATA_TEST_DIR");
  snprintf(g_tmp, sizeof(g_tmp), "%s/strata-capi-engine-XXXXXX", base && *base ? base : "/tmp");
  if (!mkdtemp(g_tmp)) {
    perror("mkdtemp");
    return 1;
  }
  test_errors();
  if (test_ram_matches_reference() == 0) test_nvme_and_checkpoint();
  free_set(g_final_ram);
  rm_tree(g_tmp);
  return check_summary("engine C API");
}
