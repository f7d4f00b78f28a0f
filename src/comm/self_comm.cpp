#include "comm/self_comm.h"

#include <fmt/format.h>

namespace strata::comm {
namespace {

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(DeviceBackend* device) : device_(device) {}

  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  const char* backend_name() const override { return "self"; }
  DeviceBackend* device() const override { return device_; }

  Status all_gather(const void* send, void* recv, std::size_t bytes, DeviceStream* stream) override {
    return copy("all_gather", recv, send, bytes, stream);
  }
  Status reduce_scatter(const float* send, float* recv, std::size_t count, DeviceStream* stream) override {
    return copy("reduce_scatter", recv, send, count * sizeof(float), stream);
  }
  Status all_reduce(const float* send, float* recv, std::size_t count, DeviceStream* stream) override {
    return copy("all_reduce", recv, send, count * sizeof(float), stream);
  }
  Status broadcast(void* data, std::size_t bytes, int root, DeviceStream* stream) override {
    if (root != 0) return Status(StatusCode::kInvalidArgument, fmt::format("broadcast: root {} of a world of 1", root));
    if (data == nullptr && bytes > 0) return Status(StatusCode::kInvalidArgument, "broadcast: null buffer");
    return stream == nullptr ? Status(StatusCode::kInvalidArgument, "broadcast: null stream") : Status();
  }
  Status barrier(DeviceStream* stream) override {
    return stream == nullptr ? Status(StatusCode::kInvalidArgument, "barrier: null stream") : Status();
  }

 private:
  Status copy(const char* what, void* dst, const void* src, std::size_t bytes, DeviceStream* stream) {
    if (bytes > 0 && (dst == nullptr || src == nullptr))
      return Status(StatusCode::kInvalidArgument, fmt::format("{}: null buffer", what));
    if (bytes == 0 || dst == src) return Status();
    Status st = device_->copy_async(dst, src, bytes, CopyKind::kDeviceToDevice, stream);
    return st.ok() ? st : st.with_context(fmt::format("{} on rank 0 of 1 (self)", what));
  }

  DeviceBackend* device_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> create_self_communicator(DeviceBackend* device) {
  if (device == nullptr) return Status(StatusCode::kInvalidArgument, "self communicator: null device backend");
  return std::unique_ptr<Communicator>(new SelfCommunicator(device));
}

}  // namespace strata::comm
