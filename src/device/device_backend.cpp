#include "device/device_backend.h"

#include <algorithm>
#include <array>

#include "common/enum_names.h"
#include "common/log.h"
#include "common/tunables.h"
#include "device/cuda_backend.h"
#include "device/cuda_loader.h"
#include "device/host_backend.h"

namespace strata {

template <>
inline constexpr auto kEnumNames<CopyKind> = std::to_array<EnumName<CopyKind>>({
    {CopyKind::kHostToDevice, "host-to-device"},
    {CopyKind::kDeviceToHost, "device-to-host"},
    {CopyKind::kDeviceToDevice, "device-to-device"},
});
template <>
inline constexpr auto kEnumNames<DeviceBackendKind> = std::to_array<EnumName<DeviceBackendKind>>(
    {{DeviceBackendKind::kAuto, "auto"}, {DeviceBackendKind::kCuda, "cuda"}, {DeviceBackendKind::kHost, "host"}});

template <>
inline constexpr auto kEnumNames<DeviceKind> =
    std::to_array<EnumName<DeviceKind>>({{DeviceKind::kHost, "host"}, {DeviceKind::kCuda, "cuda"}});

const char* device_kind_name(DeviceKind kind) { return enum_name(kind); }

const char* copy_kind_name(CopyKind kind) { return enum_name(kind, "unknown-copy"); }

Status check_cast_operands(const void* dst, DType dst_type, const void* src, DType src_type, std::size_t count) {
  if (dst == src) {
    if (dst_type != src_type)
      return Status(StatusCode::kInvalidArgument, "cast_async: in place needs the same dtype on both sides");
    return Status();
  }
  const auto pd = reinterpret_cast<uintptr_t>(dst), ps = reinterpret_cast<uintptr_t>(src);
  const std::size_t dn = count * dtype_size(dst_type), sn = count * dtype_size(src_type);
  if (pd < ps + sn && ps < pd + dn)
    return Status(StatusCode::kInvalidArgument, "cast_async: source and destination overlap");
  return Status();
}

Result<HostAllocation> DeviceBackend::alloc_pinned(std::size_t bytes) {
  STRATA_ASSIGN_OR_RETURN(HostAllocation a, alloc_host(bytes));
  if (HostMemoryRegistrar* reg = host_registrar()) {
    Status st = reg->register_memory(a.ptr, a.mapped_bytes);
    if (!st.ok()) {
      free_host(a);
      return st;
    }
  }
  return a;
}

void DeviceBackend::free_pinned(const HostAllocation& a) {
  if (!a.ptr) return;
  if (HostMemoryRegistrar* reg = host_registrar()) reg->unregister_memory(a.ptr);
  free_host(a);
}

Result<DeviceStream*> DeviceBackend::wrap_native_stream(void*, std::string_view name) {
  return Status(StatusCode::kInvalidArgument, "device backend '" + this->name() + "' cannot wrap native stream '" +
                                                  std::string(name) + "': it has no native streams");
}

Result<DeviceBackendKind> parse_device_backend_kind(std::string_view text) {
  if (text.empty()) return DeviceBackendKind::kAuto;
  if (std::optional<DeviceBackendKind> k = find_enum<DeviceBackendKind>(text)) return *k;
  return Status(StatusCode::kInvalidArgument, "unknown device backend \"" + std::string(text) + "\" (expected " +
                                                  enum_name_list<DeviceBackendKind>(", ", "", " or ") + ")");
}

Result<std::unique_ptr<DeviceBackend>> create_device_backend(const DeviceBackendOptions& options) {
  std::string why;
  if (options.kind != DeviceBackendKind::kHost) {
    auto module = load_cuda_backend();
    if (module.ok()) {
      auto b = create_cuda_backend(module.value(), options.device, options.budget_bytes);
      if (b.ok()) {
        log_once(LogLevel::kInfo, "device-backend-choice",
                 "device backend: " + b.value()->name() + ", module " + module->module_path);
        return b;
      }
      if (options.kind == DeviceBackendKind::kCuda) return b.status();
      why = b.status().message();
    } else {
      if (options.kind == DeviceBackendKind::kCuda)
        return module.status().with_context("the cuda device backend was asked for");
      why = module.status().message();
    }
  } else {
    why = "asked for";
  }
  // The GPU check (tools/gpu_check.sh) must not pass by running on the host.
  if (tunables().require_gpu && options.kind == DeviceBackendKind::kAuto)
    return Status(StatusCode::kUnavailable, "STRATA_REQUIRE_GPU=1 but no CUDA backend: " + why);
  HostBackendOptions ho;
  ho.budget_bytes = options.budget_bytes;
  if (ho.budget_bytes == 0) ho.budget_bytes = std::max<uint64_t>(host_memory_available() / 4, 256ull << 20);
  auto b = create_host_backend(ho);
  if (b.ok()) log_once(LogLevel::kInfo, "device-backend-choice", "device backend: host (" + why + ")");
  return b;
}

}  // namespace strata
