// DLPack in the C API (include/strata/strata.h): a held parameter exported as
// a DLManagedTensor (a view, no copy), and gradients taken as DLPack tensors
// whose ownership passes to the engine until its read of them is done.
//
// The DLPack structs are declared below from the DLPack specification (the
// unversioned DLManagedTensor of DLPack 0.6+, whose layout is frozen), so
// libstrata needs no dlpack.h; python/tests check them against torch's.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <cstring>
#include <string>

#include "capi/engine_handle.h"
#include "common/dtype.h"

namespace strata::capi::dl {

enum DeviceType : int32_t { kCPU = 1, kCUDA = 2, kCUDAHost = 3, kCUDAManaged = 13 };
enum TypeCode : uint8_t { kInt = 0, kUInt = 1, kFloat = 2, kBfloat = 4 };

struct Device {
  int32_t device_type;
  int32_t device_id;
};
struct DataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct Tensor {
  void* data;
  Device device;
  int32_t ndim;
  DataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; NULL: compact row-major
  uint64_t byte_offset;
};

}  // namespace strata::capi::dl

struct DLManagedTensor {
  strata::capi::dl::Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

namespace strata::capi {
namespace {

static_assert(sizeof(dl::Tensor) == 48 && offsetof(dl::Tensor, byte_offset) == 40, "DLPack's DLTensor layout");
static_assert(sizeof(DLManagedTensor) == 64, "DLPack's DLManagedTensor layout");

// An exported view: the DLManagedTensor and the arrays it points into.
struct Exported {
  DLManagedTensor m;
  int64_t shape[STRATA_MAX_DIMS];
  int64_t strides[STRATA_MAX_DIMS];
};

void delete_exported(DLManagedTensor* self) { delete static_cast<Exported*>(self->manager_ctx); }

dl::DataType dl_dtype(DType t) {
  switch (t) {
    case DType::kBF16: return {dl::kBfloat, 16, 1};
    case DType::kF16: return {dl::kFloat, 16, 1};
    default: return {dl::kFloat, 32, 1};
  }
}

std::string device_text(const dl::Device& d) {
  switch (d.device_type) {
    case dl::kCPU: return "kDLCPU";
    case dl::kCUDA: return "kDLCUDA:" + std::to_string(d.device_id);
    case dl::kCUDAHost: return "kDLCUDAHost";
    case dl::kCUDAManaged: return "kDLCUDAManaged:" + std::to_string(d.device_id);
  }
  return "device type " + std::to_string(d.device_type);
}

Result<DType> grad_dtype(const dl::DataType& t) {
  if (t.lanes == 1 && t.code == dl::kFloat && t.bits == 32) return DType::kF32;
  if (t.lanes == 1 && t.code == dl::kFloat && t.bits == 16) return DType::kF16;
  if (t.lanes == 1 && t.code == dl::kBfloat && t.bits == 16) return DType::kBF16;
  return Status(StatusCode::kInvalidArgument,
                "dtype (code " + std::to_string(t.code) + ", " + std::to_string(t.bits) + " bits, " +
                    std::to_string(t.lanes) + " lanes) is not float32, bfloat16 or float16");
}

// The tensor `t` describes gradient memory of `p`'s shape this engine can read.
Result<const void*> check_grad(strata_engine* e, const ParamSpec& p, const dl::Tensor& t) {
  const auto& dev = e->engine->device();
  const bool cuda = dev.kind() == DeviceKind::kCuda;
  const bool device_ok = cuda ? (t.device.device_type == dl::kCUDA && t.device.device_id == dev.ordinal())
                              : (t.device.device_type == dl::kCPU || t.device.device_type == dl::kCUDAHost);
  if (!device_ok)
    return Status(StatusCode::kInvalidArgument,
                  "gradient of " + p.name + " is on " + device_text(t.device) + "; the engine (" + dev.name() +
                      ") reads " + (cuda ? "kDLCUDA:" + std::to_string(dev.ordinal()) : std::string("kDLCPU")));
  if (t.ndim < 0 || t.ndim > STRATA_MAX_DIMS || (t.ndim > 0 && t.shape == nullptr))
    return Status(StatusCode::kInvalidArgument, "gradient of " + p.name + ": ndim " + std::to_string(t.ndim) +
                                                    " (or a NULL shape) is not a tensor");
  std::string want = "[", got = "[";
  bool same = static_cast<size_t>(t.ndim) == p.shape.size();
  for (size_t i = 0; i < p.shape.size(); ++i) want += (i ? ", " : "") + std::to_string(p.shape[i]);
  for (int32_t i = 0; i < t.ndim; ++i) {
    got += (i ? ", " : "") + std::to_string(t.shape[i]);
    if (same && (t.shape[i] < 0 || static_cast<uint64_t>(t.shape[i]) != p.shape[static_cast<size_t>(i)]))
      same = false;
  }
  if (!same)
    return Status(StatusCode::kInvalidArgument,
                  "gradient of " + p.name + " has shape " + got + "], the parameter " + want + "]");
  if (t.strides != nullptr) {
    int64_t expect = 1;
    for (int32_t i = t.ndim - 1; i >= 0; --i) {
      // A dimension of extent 1 may carry any stride (torch gives such).
      if (t.shape[i] != 1 && t.strides[i] != expect)
        return Status(StatusCode::kInvalidArgument,
                      "gradient of " + p.name + " is not contiguous (stride " + std::to_string(t.strides[i]) +
                          " in dimension " + std::to_string(i) + ", compact is " + std::to_string(expect) +
                          "): make it contiguous first");
      expect *= t.shape[i];
    }
  }
  if (t.data == nullptr) return Status(StatusCode::kInvalidArgument, "gradient of " + p.name + ": data is NULL");
  // The bytes must lie in the address space and be aligned for the dtype
  // (a wild byte_offset would be read later, by the accumulator).
  STRATA_ASSIGN_OR_RETURN(DType dt, grad_dtype(t.dtype));
  const uint64_t bytes = p.numel() * dtype_size(dt);
  // No process maps memory above 2^57 (x86-64 with 5-level paging; 2^47 with
  // 4; aarch64 2^52), device memory under unified addressing included.
  constexpr uint64_t kAddressLimit = uint64_t{1} << 57;
  const uint64_t start = reinterpret_cast<uintptr_t>(t.data);
  if (start >= kAddressLimit || t.byte_offset >= kAddressLimit - start ||
      bytes > kAddressLimit - start - t.byte_offset || (start + t.byte_offset) % dtype_size(dt) != 0)
    return Status(StatusCode::kInvalidArgument,
                  "gradient of " + p.name + ": byte_offset " + std::to_string(t.byte_offset) +
                      " puts its data outside the address space or misaligned for its dtype");
  return static_cast<const void*>(static_cast<const char*>(t.data) + t.byte_offset);
}

void give_back(DLManagedTensor* m) {
  if (m->deleter) m->deleter(m);
}

}  // namespace

Status dlpack_collect(strata_engine* e, bool all) {
  auto& pending = e->dlpack_pending;
  DeviceBackend& dev = e->engine->device();
  Status first;
  size_t kept = 0;
  for (size_t i = 0; i < pending.size(); ++i) {
    auto& p = pending[i];
    bool done;
    if (all) {
      Status st = dev.synchronize(p.read);
      if (!st.ok() && first.ok()) first = st;
      done = true;  // a stream error: the engine's work is over either way
    } else {
      auto q = dev.query(p.read);
      done = !q.ok() || *q;
    }
    if (done) {
      give_back(p.tensor);
      e->dlpack_events.push_back(p.read);
    } else {
      pending[kept++] = p;
    }
  }
  pending.resize(kept);
  return first;
}

void dlpack_drop_all(strata_engine* e) {
  (void)dlpack_collect(e, true);
  if (e->engine)
    for (DeviceEvent* ev : e->dlpack_events) e->engine->device().destroy_event(ev);
  e->dlpack_events.clear();
}

}  // namespace strata::capi

using namespace strata;
using namespace strata::capi;

extern "C" {

strata_status_t strata_engine_param_dlpack(strata_engine_t engine, uint32_t param, DLManagedTensor** out) {
  return on_engine(engine, "strata_engine_param_dlpack", [&]() -> Status {
    if (!out) return null_arg("strata_engine_param_dlpack", "out");
    Engine& e = *engine->engine;
    STRATA_RETURN_IF_ERROR(check_param(e, param));
    STRATA_ASSIGN_OR_RETURN(void* ptr, e.held_ptr(param));
    const ParamSpec& p = e.model().params[param];
    auto x = std::make_unique<Exported>();
    DLManagedTensor& m = x->m;
    std::memset(&m, 0, sizeof(m));
    m.dl_tensor.data = ptr;
    const DeviceBackend& dev = e.device();
    m.dl_tensor.device = dev.kind() == DeviceKind::kCuda ? dl::Device{dl::kCUDA, dev.ordinal()} : dl::Device{dl::kCPU, 0};
    m.dl_tensor.ndim = static_cast<int32_t>(p.shape.size());
    m.dl_tensor.dtype = dl_dtype(p.compute_dtype);
    int64_t stride = 1;
    for (int i = static_cast<int>(p.shape.size()) - 1; i >= 0; --i) {
      x->shape[i] = static_cast<int64_t>(p.shape[static_cast<size_t>(i)]);
      x->strides[i] = stride;
      stride *= x->shape[i];
    }
    m.dl_tensor.shape = x->shape;
    m.dl_tensor.strides = x->strides;
    m.manager_ctx = x.get();
    m.deleter = delete_exported;
    *out = &x.release()->m;
    return Status();
  });
}

strata_status_t strata_engine_reduce_grad_dlpack(strata_engine_t engine, uint32_t param, DLManagedTensor* grad,
                                                 strata_stream_t stream) {
  return on_engine(engine, "strata_engine_reduce_grad_dlpack", [&]() -> Status {
    if (!grad) return null_arg("strata_engine_reduce_grad_dlpack", "grad");
    Engine& e = *engine->engine;
    STRATA_RETURN_IF_ERROR(check_param(e, param));
    STRATA_ASSIGN_OR_RETURN(DeviceStream * s, stream_arg(engine, stream));
    (void)dlpack_collect(engine, false);
    const ParamSpec& p = e.model().params[param];
    STRATA_ASSIGN_OR_RETURN(DType dt, grad_dtype(grad->dl_tensor.dtype));
    STRATA_ASSIGN_OR_RETURN(const void* data, check_grad(engine, p, grad->dl_tensor));
    // The event that says the read is done, taken before the reduce so a
    // failure to make one leaves nothing half done.
    DeviceEvent* ev;
    if (!engine->dlpack_events.empty()) {
      ev = engine->dlpack_events.back();
      engine->dlpack_events.pop_back();
    } else {
      STRATA_ASSIGN_OR_RETURN(ev, e.device().create_event());
    }
    // Room for the entry before the reduce, so the push_back below cannot
    // throw after the engine took the gradient (grown geometrically: reserve
    // of size + 1 would reallocate on every call).
    auto& pending = engine->dlpack_pending;
    if (pending.size() == pending.capacity()) pending.reserve(std::max<size_t>(16, 2 * pending.capacity()));
    Status st = e.reduce_grad(param, data, dt, s);
    // Work enqueued on `stream` after reduce_grad runs after the engine's
    // read (its contract), so this event passing means the read is done.
    if (!st.ok()) {
      engine->dlpack_events.push_back(ev);
      return st;  // the caller keeps the tensor
    }
    if (!e.device().record(ev, s).ok()) {
      // The gradient was taken: give it back once the stream is past the
      // read (a stream error surfaces at step).
      (void)e.device().synchronize(s);
      engine->dlpack_events.push_back(ev);
      give_back(grad);
      return Status();
    }
    engine->dlpack_pending.push_back({grad, ev});
    return Status();
  });
}

}  // extern "C"
