/* The C API used from plain C (C11), as a trainer written in C would: status
 * strings, version, errors, and the CPU AdamW checked against a reference
 * written here in double. Exit status 0 = pass. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c_check.h"
#include "strata/strata.h"


static void test_basics(void) {
  CHECK(strata_api_version() == STRATA_API_VERSION);
  CHECK(strcmp(strata_status_string(STRATA_OK), "STRATA_OK") == 0);
  CHECK(strcmp(strata_status_string(STRATA_ERR_NO_SPACE), "STRATA_ERR_NO_SPACE") == 0);
  CHECK(strcmp(strata_status_string((strata_status_t)999), "STRATA_ERR_UNKNOWN") == 0);
  CHECK(strlen(strata_version()) > 0);
  CHECK(strata_last_error() != NULL);
}

static void test_errors(void) {
  strata_optimizer_config_t cfg;
  CHECK(strata_optimizer_config_init(STRATA_OPTIMIZER_ADAMW, NULL) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strlen(strata_last_error()) > 0);
  CHECK(strata_optimizer_config_init((strata_optimizer_kind_t)42, &cfg) == STRATA_ERR_INVALID_ARGUMENT);

  strata_cpu_optimizer_t opt = NULL;
  CHECK(strata_cpu_optimizer_create(STRATA_ISA_AUTO, -1, &opt) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strata_cpu_optimizer_create(STRATA_ISA_AUTO, 100000, &opt) == STRATA_ERR_INVALID_ARGUMENT);
#if defined(__x86_64__)
  /* NEON cannot run on x86: a clear error, not a crash. */
  CHECK(strata_cpu_optimizer_create(STRATA_ISA_NEON, 1, &opt) == STRATA_ERR_UNAVAILABLE);
  CHECK(strstr(strata_last_error(), "neon") != NULL || strstr(strata_last_error(), "NEON") != NULL);
#endif
  CHECK(strata_cpu_optimizer_create(STRATA_ISA_AUTO, 1, &opt) == STRATA_OK);
  CHECK(strata_optimizer_config_init(STRATA_OPTIMIZER_ADAMW, &cfg) == STRATA_OK);
  float p = 1, g = 1, m = 0, v = 0;
  strata_optimizer_buffers_t buf;
  memset(&buf, 0, sizeof(buf));
  buf.params = &p;
  buf.grads = &g;
  buf.state[0] = &m;
  buf.state[1] = &v;
  /* struct_size left 0: refused, and nothing modified. */
  CHECK(strata_cpu_optimizer_step(opt, &cfg, 1, &buf, 1) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(strstr(strata_cpu_optimizer_last_error(opt), "struct_size") != NULL);
  CHECK(p == 1.0f && m == 0.0f);
  buf.struct_size = sizeof(buf);
  CHECK(strata_cpu_optimizer_step(opt, &cfg, 0, &buf, 1) == STRATA_ERR_INVALID_ARGUMENT); /* step < 1 */
  cfg.lr = -1;
  CHECK(strata_cpu_optimizer_step(opt, &cfg, 1, &buf, 1) == STRATA_ERR_INVALID_ARGUMENT);
  CHECK(p == 1.0f);
  strata_cpu_optimizer_destroy(opt);
  strata_cpu_optimizer_destroy(NULL);
}

static void test_adamw_matches_reference(void) {
  enum { N = 1003, STEPS = 5 };
  float* p = malloc(N * sizeof(float));
  float* g = malloc(N * sizeof(float));
  float* m = calloc(N, sizeof(float));
  float* v = calloc(N, sizeof(float));
  double* rp = malloc(N * sizeof(double));
  double* rm = calloc(N, sizeof(double));
  double* rv = calloc(N, sizeof(double));
  unsigned seed = 12345;
  for (int i = 0; i < N; ++i) {
    seed = seed * 1103515245u + 12345u;
    p[i] = (float)((seed >> 8) % 2001) / 1000.0f - 1.0f;
    rp[i] = p[i];
  }
  strata_cpu_optimizer_t opt = NULL;
  strata_optimizer_config_t cfg;
  CHECK(strata_cpu_optimizer_create(STRATA_ISA_AUTO, 2, &opt) == STRATA_OK);
  CHECK(strata_optimizer_config_init(STRATA_OPTIMIZER_ADAMW, &cfg) == STRATA_OK);
  int nstates = -1;
  CHECK(strata_optimizer_state_count(&cfg, &nstates) == STRATA_OK && nstates == 2);
  cfg.lr = 1e-2;
  strata_optimizer_buffers_t buf;
  memset(&buf, 0, sizeof(buf));
  buf.struct_size = sizeof(buf);
  buf.params = p;
  buf.grads = g;
  buf.grad_dtype = STRATA_DTYPE_F32;
  buf.state[0] = m;
  buf.state[1] = v;
  buf.state_dtype = STRATA_DTYPE_F32;
  for (int t = 1; t <= STEPS; ++t) {
    for (int i = 0; i < N; ++i) {
      seed = seed * 1103515245u + 12345u;
      g[i] = (float)((seed >> 8) % 2001) / 1000.0f - 1.0f;
    }
    CHECK(strata_cpu_optimizer_step(opt, &cfg, t, &buf, N) == STRATA_OK);
    /* torch.optim.AdamW, single tensor, in double. */
    double bc1 = 1 - pow(cfg.beta1, t), bc2 = 1 - pow(cfg.beta2, t);
    for (int i = 0; i < N; ++i) {
      rp[i] *= 1 - cfg.lr * cfg.weight_decay;
      rm[i] = cfg.beta1 * rm[i] + (1 - cfg.beta1) * g[i];
      rv[i] = cfg.beta2 * rv[i] + (1 - cfg.beta2) * (double)g[i] * g[i];
      rp[i] -= cfg.lr / bc1 * rm[i] / (sqrt(rv[i]) / sqrt(bc2) + cfg.eps);
    }
  }
  double worst = 0;
  for (int i = 0; i < N; ++i) {
    double err = fabs(p[i] - rp[i]) / (fabs(rp[i]) + 1e-3);
    if (err > worst) worst = err;
  }
  CHECK(worst < 1e-5);
  double sum_sq = 0;
  int bad = 1;
  CHECK(strata_cpu_grad_stats(opt, g, STRATA_DTYPE_F32, N, 1.0, &sum_sq, &bad) == STRATA_OK);
  double ref = 0;
  for (int i = 0; i < N; ++i) ref += (double)g[i] * g[i];
  CHECK(bad == 0 && fabs(sum_sq - ref) <= 1e-9 * ref);
  g[7] = INFINITY;
  CHECK(strata_cpu_grad_stats(opt, g, STRATA_DTYPE_F32, N, 1.0, &sum_sq, &bad) == STRATA_OK && bad == 1);
  strata_cpu_optimizer_destroy(opt);
  free(p); free(g); free(m); free(v); free(rp); free(rm); free(rv);
}

int main(void) {
  test_basics();
  test_errors();
  test_adamw_matches_reference();
  return check_summary("c api");
}
