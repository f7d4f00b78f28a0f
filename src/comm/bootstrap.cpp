#include "comm/bootstrap.h"

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <optional>

#include <fmt/format.h>

namespace strata::comm {

const char* launcher_name(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone: return "none";
    case Launcher::kMpirun: return "mpirun";
    case Launcher::kTorchrun: return "torchrun";
  }
  return "?";
}

namespace {

// The variable as an integer in [lo, hi]; nullopt when unset.
Result<std::optional<long>> read_int(const EnvLookup& env, const char* name, long lo, long hi) {
  const char* v = env(name);
  if (v == nullptr) return std::optional<long>();
  long x = 0;
  const char* end = v + std::strlen(v);
  auto [p, ec] = std::from_chars(v, end, x);
  if (*v == '\0' || ec != std::errc() || p != end)
    return Status(StatusCode::kInvalidArgument, fmt::format("{}='{}' is not a decimal integer", name, v));
  if (x < lo || x > hi)
    return Status(StatusCode::kInvalidArgument, fmt::format("{}={} is out of range [{}, {}]", name, x, lo, hi));
  return std::optional<long>(x);
}

constexpr long kMaxWorld = 1 << 20;

// rank/world/local from three variables, all or none (local optional).
struct Triple {
  std::optional<long> rank, world, local;
};
Result<Triple> read_triple(const EnvLookup& env, const char* rank, const char* world, const char* local) {
  Triple t;
  STRATA_ASSIGN_OR_RETURN(t.rank, read_int(env, rank, 0, kMaxWorld - 1));
  STRATA_ASSIGN_OR_RETURN(t.world, read_int(env, world, 1, kMaxWorld));
  STRATA_ASSIGN_OR_RETURN(t.local, read_int(env, local, 0, kMaxWorld - 1));
  if (t.rank.has_value() != t.world.has_value())
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{} is set but {} is not: set both", t.rank ? rank : world, t.rank ? world : rank));
  if (!t.rank && t.local)
    return Status(StatusCode::kInvalidArgument, fmt::format("{} is set without {} and {}", local, rank, world));
  if (t.rank && *t.rank >= *t.world)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}={} is not below {}={}", rank, *t.rank, world, *t.world));
  if (t.local && *t.local >= *t.world)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("{}={} is not below {}={}", local, *t.local, world, *t.world));
  return t;
}

}  // namespace

Result<LaunchInfo> detect_launch(const EnvLookup& env_in) {
  const EnvLookup env = env_in ? env_in : EnvLookup([](const char* n) { return std::getenv(n); });
  STRATA_ASSIGN_OR_RETURN(Triple ompi,
                          read_triple(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"));
  STRATA_ASSIGN_OR_RETURN(Triple torch, read_triple(env, "RANK", "WORLD_SIZE", "LOCAL_RANK"));
  LaunchInfo info;
  if (ompi.rank) {
    // Both sets present (a torchrun-style script under mpirun): they must agree.
    if (torch.rank && (*torch.rank != *ompi.rank || *torch.world != *ompi.world))
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("mpirun says rank {} of {} (OMPI_COMM_WORLD_RANK/SIZE) but RANK={} WORLD_SIZE={}",
                                *ompi.rank, *ompi.world, *torch.rank, *torch.world));
    info.launcher = Launcher::kMpirun;
    info.rank = static_cast<int>(*ompi.rank);
    info.world_size = static_cast<int>(*ompi.world);
    info.local_rank = static_cast<int>(ompi.local.value_or(0));
    return info;
  }
  if (!torch.rank) {
    if (env("MASTER_ADDR") || env("MASTER_PORT"))
      return Status(StatusCode::kInvalidArgument, "MASTER_ADDR/MASTER_PORT are set without RANK and WORLD_SIZE");
    return info;  // one rank
  }
  info.launcher = Launcher::kTorchrun;
  info.rank = static_cast<int>(*torch.rank);
  info.world_size = static_cast<int>(*torch.world);
  info.local_rank = static_cast<int>(torch.local.value_or(0));
  if (info.world_size > 1 || env("MASTER_ADDR") || env("MASTER_PORT")) {
    const char* addr = env("MASTER_ADDR");
    if (addr == nullptr || *addr == '\0')
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("RANK/WORLD_SIZE={} are set but MASTER_ADDR is not", info.world_size));
    STRATA_ASSIGN_OR_RETURN(std::optional<long> port, read_int(env, "MASTER_PORT", 1, 65535));
    if (!port)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("RANK/WORLD_SIZE={} are set but MASTER_PORT is not", info.world_size));
    info.master_addr = addr;
    info.master_port = static_cast<uint16_t>(*port);
  }
  return info;
}

}  // namespace strata::comm
