#include "comm/p2p_communicator.h"

#include <fmt/format.h>

#include <cstring>

namespace strata::comm {
namespace {

// acc = parts[0]; acc += parts[1]; ... (communicator.h's fixed order).
// Plain fp32 adds; this file is built with -ffp-contract=off, so nothing here
// is contracted into an FMA.
void sum_in_rank_order(const std::vector<const float*>& parts, float* acc, std::size_t n) {
  if (n == 0) return;  // empty chunks may come with null pointers (memcpy's contract)
  if (acc != parts[0]) std::memcpy(acc, parts[0], n * sizeof(float));
  for (std::size_t r = 1; r < parts.size(); ++r) {
    const float* in = parts[r];
    for (std::size_t i = 0; i < n; ++i) acc[i] += in[i];
  }
}

}  // namespace

std::string P2pOp::where() const {
  return fmt::format("{} #{} on rank {} of {} ({})", name, seq, rank, world, backend);
}

template <typename Body>
Status P2pCommunicator::enqueue(const char* name, DeviceStream* stream, Body body) {
  if (stream == nullptr) return Status(StatusCode::kInvalidArgument, fmt::format("{}: null stream", name));
  if (Status broken = broken_status(); !broken.ok()) return broken;
  const uint64_t seq = next_seq_.fetch_add(1);
  return device_->host_func_async(stream, [this, name, seq, body]() -> Status {
    if (Status broken = broken_status(); !broken.ok()) return broken;
    std::unique_ptr<P2pOp> op = make_op(name, seq);
    op->start = std::chrono::steady_clock::now();
    Status st = body(*op);
    if (!st.ok()) {
      // Broken first, so that the first error is the one kept (another
      // stream's collective fails because of this abandon()).
      break_with(st);
      abandon(*op);
    }
    return st;
  });
}

Status P2pCommunicator::all_gather(const void* send, void* recv, std::size_t bytes, DeviceStream* stream) {
  if (bytes > 0 && (send == nullptr || recv == nullptr))
    return Status(StatusCode::kInvalidArgument, "all_gather: null buffer");
  return enqueue("all_gather", stream, [=, this](P2pOp& op) -> Status {
    auto* out = static_cast<char*>(recv);
    char* own = out + static_cast<std::size_t>(rank_) * bytes;
    if (bytes == 0) return Status();
    if (own != send) std::memmove(own, send, bytes);
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      STRATA_RETURN_IF_ERROR(post(op, false, own, bytes, p, 0));
      STRATA_RETURN_IF_ERROR(post(op, true, out + static_cast<std::size_t>(p) * bytes, bytes, p, 0));
    }
    return wait(op);
  });
}

Status P2pCommunicator::reduce_scatter(const float* send, float* recv, std::size_t count, DeviceStream* stream) {
  if (count > 0 && (send == nullptr || recv == nullptr))
    return Status(StatusCode::kInvalidArgument, "reduce_scatter: null buffer");
  return enqueue("reduce_scatter", stream, [=, this](P2pOp& op) -> Status {
    if (count == 0) return Status();
    // Every rank's slice `rank_`, by rank: own from `send`, others received.
    std::vector<const float*> parts(static_cast<std::size_t>(world_));
    auto stage = std::make_shared<std::vector<float>>(count * static_cast<std::size_t>(world_ - 1));
    op.stage = stage;
    for (int p = 0, slot = 0; p < world_; ++p) {
      if (p == rank_) {
        parts[p] = send + static_cast<std::size_t>(rank_) * count;
        continue;
      }
      float* in = stage->data() + static_cast<std::size_t>(slot++) * count;
      parts[p] = in;
      STRATA_RETURN_IF_ERROR(
          post(op, false, const_cast<float*>(send) + static_cast<std::size_t>(p) * count, count * sizeof(float), p, 0));
      STRATA_RETURN_IF_ERROR(post(op, true, in, count * sizeof(float), p, 0));
    }
    STRATA_RETURN_IF_ERROR(wait(op));
    sum_in_rank_order(parts, recv, count);
    return Status();
  });
}

Status P2pCommunicator::all_reduce(const float* send, float* recv, std::size_t count, DeviceStream* stream) {
  if (count > 0 && (send == nullptr || recv == nullptr))
    return Status(StatusCode::kInvalidArgument, "all_reduce: null buffer");
  return enqueue("all_reduce", stream, [=, this](P2pOp& op) -> Status {
    if (count == 0) return Status();
    auto begin = [&](int r) {
      return static_cast<std::size_t>(static_cast<unsigned __int128>(count) * static_cast<unsigned>(r) /
                                      static_cast<unsigned>(world_));
    };
    const std::size_t mine = begin(rank_), mine_n = begin(rank_ + 1) - mine;
    // Phase 0 (reduce-scatter of uneven chunks): chunk `rank_` of every rank.
    std::vector<const float*> parts(static_cast<std::size_t>(world_));
    auto stage = std::make_shared<std::vector<float>>(mine_n * static_cast<std::size_t>(world_));
    op.stage = stage;
    for (int p = 0, slot = 1; p < world_; ++p) {
      if (p == rank_) {
        parts[p] = send + mine;
        continue;
      }
      float* in = stage->data() + static_cast<std::size_t>(slot++) * mine_n;
      parts[p] = in;
      const std::size_t pb = begin(p), pn = begin(p + 1) - pb;
      STRATA_RETURN_IF_ERROR(post(op, false, const_cast<float*>(send) + pb, pn * sizeof(float), p, 0));
      STRATA_RETURN_IF_ERROR(post(op, true, in, mine_n * sizeof(float), p, 0));
    }
    STRATA_RETURN_IF_ERROR(wait(op));
    // Slot 0 of the stage holds the sum: send may be recv (in place), and
    // recv's chunk must not change before the sum has read send's.
    float* acc = stage->data();
    sum_in_rank_order(parts, acc, mine_n);
    if (mine_n > 0) std::memcpy(recv + mine, acc, mine_n * sizeof(float));
    // Phase 1 (all-gather of the summed chunks).
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      const std::size_t pb = begin(p), pn = begin(p + 1) - pb;
      STRATA_RETURN_IF_ERROR(post(op, false, recv + mine, mine_n * sizeof(float), p, 1));
      STRATA_RETURN_IF_ERROR(post(op, true, recv + pb, pn * sizeof(float), p, 1));
    }
    return wait(op);
  });
}

Status P2pCommunicator::broadcast(void* data, std::size_t bytes, int root, DeviceStream* stream) {
  if (root < 0 || root >= world_)
    return Status(StatusCode::kInvalidArgument, fmt::format("broadcast: root {} of a world of {}", root, world_));
  if (bytes > 0 && data == nullptr) return Status(StatusCode::kInvalidArgument, "broadcast: null buffer");
  return enqueue("broadcast", stream, [=, this](P2pOp& op) -> Status {
    if (bytes == 0) return Status();
    if (rank_ == root) {
      for (int p = 0; p < world_; ++p)
        if (p != root) STRATA_RETURN_IF_ERROR(post(op, false, data, bytes, p, 0));
    } else {
      STRATA_RETURN_IF_ERROR(post(op, true, data, bytes, root, 0));
    }
    return wait(op);
  });
}

Status P2pCommunicator::barrier(DeviceStream* stream) {
  return enqueue("barrier", stream, [this](P2pOp& op) -> Status {
    // An empty message to and from every peer: done once all have arrived.
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      STRATA_RETURN_IF_ERROR(post(op, false, nullptr, 0, p, 0));
      STRATA_RETURN_IF_ERROR(post(op, true, nullptr, 0, p, 0));
    }
    return wait(op);
  });
}

Status P2pCommunicator::broken_status() {
  std::lock_guard<std::mutex> lock(mu_);
  if (first_error_.ok()) return Status();
  return Status(first_error_.code(), "communicator broken by an earlier failure: " + first_error_.message());
}

void P2pCommunicator::break_with(const Status& st) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (first_error_.ok()) {
      first_error_ = st;
      first = true;
    }
  }
  if (first) on_broken(st);
}

void P2pCommunicator::graveyard_add(std::shared_ptr<std::vector<float>> mem) {
  std::lock_guard<std::mutex> lock(mu_);
  graveyard_.push_back(std::move(mem));
}

}  // namespace strata::comm
