#include "cpu_optim/membw.h"

#include <algorithm>

#include "cpu_optim/arch/kernel_table.h"
#include "cpu_optim/dispatch.h"

namespace strata::cpu_optim {

Status membw_rmw(float* b, const float* c, float s, std::size_t count, const ExecOptions& exec) {
  if (count > 0 && (!b || !c)) return Status(StatusCode::kInvalidArgument, "membw_rmw: null buffer");
  STRATA_ASSIGN_OR_RETURN(Isa isa, resolve_isa(exec.isa));
  const detail::KernelTable* table = detail::kernels_for(isa);
  const std::size_t nblocks = (count + detail::kStepBlock - 1) / detail::kStepBlock;
  struct Ctx {
    detail::MembwFn fn;
    float* b;
    const float* c;
    float s;
    std::size_t count;
  } ctx{table->membw, b, c, s, count};
  detail::parallel_blocks(
      nblocks, detail::resolve_threads(exec.threads),
      [](void* p, std::size_t b0, std::size_t b1) {
        auto* x = static_cast<Ctx*>(p);
        x->fn(x->b, x->c, x->s, b0 * detail::kStepBlock, std::min(x->count, b1 * detail::kStepBlock));
      },
      &ctx);
  return Status::ok_status();
}

}  // namespace strata::cpu_optim
