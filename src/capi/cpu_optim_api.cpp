// C API of the CPU optimizers (include/strata/strata.h) over cpu_optim/.
#include <cstddef>
#include <string>

#include "capi/c_api_util.h"
#include "cpu_optim/optimizer.h"
#include "strata/strata.h"

struct strata_cpu_optimizer {
  strata::cpu_optim::ExecOptions exec;
  std::string last_error;
};

namespace strata::capi {
namespace {

using cpu_optim::DType;
using cpu_optim::Isa;
using cpu_optim::OptimizerKind;

Result<DType> to_dtype(const strata_dtype_t& dtype, const char* field) {
  const int d = enum_value(dtype);
  switch (d) {
    case STRATA_DTYPE_F32: return DType::kF32;
    case STRATA_DTYPE_BF16: return DType::kBF16;
    case STRATA_DTYPE_F16: return DType::kF16;
  }
  return Status(StatusCode::kInvalidArgument, std::string(field) + ": unknown dtype " + std::to_string(d));
}

Result<cpu_optim::OptimizerConfig> to_config(const strata_optimizer_config_t* c) {
  STRATA_RETURN_IF_ERROR(check_struct(c, "config"));
  const int kind = enum_value(c->kind);
  if (kind < STRATA_OPTIMIZER_ADAMW || kind > STRATA_OPTIMIZER_SGD)
    return Status(StatusCode::kInvalidArgument, "config.kind: unknown optimizer " + std::to_string(kind));
  cpu_optim::OptimizerConfig o;
  o.kind = static_cast<OptimizerKind>(kind);
  o.lr = c->lr;
  o.beta1 = c->beta1;
  o.beta2 = c->beta2;
  o.eps = c->eps;
  o.weight_decay = c->weight_decay;
  o.amsgrad = c->amsgrad != 0;
  o.momentum = c->momentum;
  o.dampening = c->dampening;
  o.nesterov = c->nesterov != 0;
  o.lr_decay = c->lr_decay;
  o.maximize = c->maximize != 0;
  o.grad_scale = c->grad_scale;
  return o;
}

strata_status_t fail_on(strata_cpu_optimizer* opt, const Status& st) {
  opt->last_error = st.message();
  return to_c_status(st.code());
}

}  // namespace
}  // namespace strata::capi

using namespace strata;
using namespace strata::capi;

extern "C" {

strata_status_t strata_optimizer_config_init(strata_optimizer_kind_t kind, strata_optimizer_config_t* config) {
  if (!config) return invalid("strata_optimizer_config_init: config is NULL");
  const int k = enum_value(kind);
  if (k < STRATA_OPTIMIZER_ADAMW || k > STRATA_OPTIMIZER_SGD)
    return invalid("strata_optimizer_config_init: unknown optimizer kind " + std::to_string(k));
  strata_optimizer_config_t c{};
  c.struct_size = sizeof(c);
  c.kind = kind;
  c.lr = 1e-3;
  c.beta1 = 0.9;
  c.beta2 = 0.999;
  c.eps = 1e-8;
  c.grad_scale = 1.0;
  switch (k) {
    case STRATA_OPTIMIZER_ADAMW: c.weight_decay = 1e-2; break;
    case STRATA_OPTIMIZER_ADAM: break;
    case STRATA_OPTIMIZER_ADAGRAD: c.lr = 1e-2; c.eps = 1e-10; break;
    case STRATA_OPTIMIZER_LION: c.lr = 1e-4; c.beta2 = 0.99; break;
    case STRATA_OPTIMIZER_SGD: break;
  }
  *config = c;
  return STRATA_OK;
}

strata_status_t strata_optimizer_state_count(const strata_optimizer_config_t* config, int* count) {
  auto c = to_config(config);
  if (!c.ok()) return fail(c.status().with_context("strata_optimizer_state_count"));
  if (!count) return invalid("strata_optimizer_state_count: count is NULL");
  *count = cpu_optim::state_count(c.value());
  return STRATA_OK;
}

strata_status_t strata_cpu_optimizer_create(strata_isa_t isa, int threads, strata_cpu_optimizer_t* out) {
  if (!out) return invalid("strata_cpu_optimizer_create: out is NULL");
  const int isa_code = enum_value(isa);
  if (isa_code < STRATA_ISA_AUTO || isa_code > STRATA_ISA_NEON)
    return invalid("strata_cpu_optimizer_create: unknown isa " + std::to_string(isa_code));
  if (threads < 0 || threads > (1 << 16))
    return invalid("strata_cpu_optimizer_create: threads is " + std::to_string(threads) + ", outside [0, 65536]");
  cpu_optim::ExecOptions exec;
  exec.isa = static_cast<Isa>(isa_code);
  exec.threads = threads;
  // Probe the ISA once now so an impossible choice fails here, not mid-training.
  float p = 0, g = 0;
  cpu_optim::StepBuffers b;
  b.params = &p;
  b.grads = &g;
  cpu_optim::OptimizerConfig probe;
  probe.kind = OptimizerKind::kSgd;
  Status st = cpu_optim::step(probe, 1, b, 1, exec);
  if (!st.ok()) return fail(st.with_context("strata_cpu_optimizer_create"));
  auto* opt = new (std::nothrow) strata_cpu_optimizer;
  if (!opt) return fail(Status(StatusCode::kOutOfMemory, "strata_cpu_optimizer_create: out of memory"));
  opt->exec = exec;
  *out = opt;
  return STRATA_OK;
}

void strata_cpu_optimizer_destroy(strata_cpu_optimizer_t opt) { delete opt; }

strata_status_t strata_cpu_optimizer_step(strata_cpu_optimizer_t opt, const strata_optimizer_config_t* config,
                                          int64_t step, const strata_optimizer_buffers_t* buffers, size_t count) {
  if (!opt) return invalid("strata_cpu_optimizer_step: opt is NULL");
  auto c = to_config(config);
  if (!c.ok()) return fail_on(opt, c.status());
  Status st = check_struct(buffers, "buffers");
  if (!st.ok()) return fail_on(opt, st);
  cpu_optim::StepBuffers b;
  b.params = buffers->params;
  b.grads = buffers->grads;
  auto gd = to_dtype(buffers->grad_dtype, "buffers.grad_dtype");
  if (!gd.ok()) return fail_on(opt, gd.status());
  auto sd = to_dtype(buffers->state_dtype, "buffers.state_dtype");
  if (!sd.ok()) return fail_on(opt, sd.status());
  auto od = to_dtype(buffers->out_dtype, "buffers.out_dtype");
  if (buffers->params_out && !od.ok()) return fail_on(opt, od.status());
  b.grad_dtype = gd.value();
  b.state_dtype = sd.value();
  for (int i = 0; i < 3; ++i) b.state[i] = buffers->state[i];
  b.params_out = buffers->params_out;
  if (od.ok()) b.out_dtype = od.value();
  st = cpu_optim::step(c.value(), step, b, count, opt->exec);
  if (!st.ok()) return fail_on(opt, st);
  return STRATA_OK;
}

strata_status_t strata_cpu_grad_stats(strata_cpu_optimizer_t opt, const void* grads, strata_dtype_t dtype,
                                      size_t count, double grad_scale, double* sum_sq, int* has_inf_nan) {
  if (!opt) return invalid("strata_cpu_grad_stats: opt is NULL");
  if (!sum_sq || !has_inf_nan) return fail_on(opt, Status(StatusCode::kInvalidArgument, "sum_sq or has_inf_nan is NULL"));
  auto d = to_dtype(dtype, "dtype");
  if (!d.ok()) return fail_on(opt, d.status());
  auto r = cpu_optim::grad_stats(grads, d.value(), count, grad_scale, opt->exec);
  if (!r.ok()) return fail_on(opt, r.status());
  *sum_sq = r->sum_sq;
  *has_inf_nan = r->has_inf_nan ? 1 : 0;
  return STRATA_OK;
}

const char* strata_cpu_optimizer_last_error(strata_cpu_optimizer_t opt) {
  return opt ? opt->last_error.c_str() : "";
}

}  // extern "C"
