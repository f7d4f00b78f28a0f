#include "io/pinned_pool.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/log.h"

namespace strata::io {

namespace {
std::size_t round_up(std::size_t v, std::size_t a) {
  return (v + a - 1) / a * a;
}
}  // namespace

// ---------------------------------------------------------------- PinnedBuffer

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept
    : pool_(o.pool_), ptr_(o.ptr_), bytes_(o.bytes_), reserved_(o.reserved_) {
  o.pool_ = nullptr;
  o.ptr_ = nullptr;
  o.bytes_ = o.reserved_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    pool_ = o.pool_;
    ptr_ = o.ptr_;
    bytes_ = o.bytes_;
    reserved_ = o.reserved_;
    o.pool_ = nullptr;
    o.ptr_ = nullptr;
    o.bytes_ = o.reserved_ = 0;
  }
  return *this;
}

void PinnedBuffer::reset() {
  if (pool_ && ptr_) pool_->release(ptr_, reserved_);
  pool_ = nullptr;
  ptr_ = nullptr;
  bytes_ = reserved_ = 0;
}

// ---------------------------------------------------------------- PinnedPool

Result<std::unique_ptr<PinnedPool>> PinnedPool::create(const PinnedPoolOptions& options) {
  if (options.budget_bytes == 0) return Status(StatusCode::kInvalidArgument, "pinned pool: the budget is 0 bytes");
  const std::size_t a = options.alignment;
  if (a < 512 || (a & (a - 1)) || a > kHugePageSize)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("pinned pool: alignment {} is not a power of two in 512..2 MiB", a));
  PinnedPoolOptions o = options;
  o.slab_bytes = round_up(std::max<std::size_t>(o.slab_bytes, kHugePageSize), kHugePageSize);
  for (auto* r : o.registrars)
    if (!r) return Status(StatusCode::kInvalidArgument, "pinned pool: a null registrar");
  return std::unique_ptr<PinnedPool>(new PinnedPool(o));
}

PinnedPool::~PinnedPool() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& s : slabs_) {
    if (s->used != 0) {
      log_error("pinned pool destroyed with {} bytes still in buffers: leaking their {}-byte slab", s->used,
                s->mem.mapped_bytes);
      continue;
    }
    unmap_slab(*s);
  }
}

bool PinnedPool::carve(Slab& s, std::size_t bytes, std::size_t* offset) {
  for (auto it = s.free.begin(); it != s.free.end(); ++it) {
    if (it->second < bytes) continue;
    *offset = it->first;
    std::size_t rest = it->second - bytes;
    std::size_t next = it->first + bytes;
    s.free.erase(it);
    if (rest) s.free.emplace(next, rest);
    s.used += bytes;
    return true;
  }
  return false;
}

Status PinnedPool::map_slab(std::size_t bytes, std::unique_ptr<Slab>* out) {
  auto mem = alloc_host(bytes, std::max<std::size_t>(options_.alignment, 4096));
  if (!mem.ok()) return mem.status().with_context("pinned pool");
  auto s = std::make_unique<Slab>();
  s->mem = mem.value();
  for (auto* r : options_.registrars) {
    Status st = r->register_memory(s->mem.ptr, s->mem.mapped_bytes);
    if (!st.ok()) {
      unmap_slab(*s);  // unregisters the ones that accepted it, then unmaps
      return st.with_context(
          fmt::format("pinned pool: registering a {}-byte slab with {}", s->mem.mapped_bytes, r->name()));
    }
    ++s->registered;
  }
  s->free.emplace(0, s->mem.mapped_bytes);
  *out = std::move(s);
  return {};
}

void PinnedPool::unmap_slab(Slab& s) {
  for (std::size_t i = s.registered; i-- > 0;) options_.registrars[i]->unregister_memory(s.mem.ptr);
  s.registered = 0;
  free_host(s.mem);
  s.mem = {};
}

Result<PinnedBuffer> PinnedPool::allocate(std::size_t bytes) {
  if (bytes == 0) return Status(StatusCode::kInvalidArgument, "pinned pool: asked for 0 bytes");
  std::lock_guard<std::mutex> lock(mu_);
  auto over_budget = [&] {
    return Status(StatusCode::kOutOfBudget,
                  fmt::format("pinned pool: asked for {} bytes but only {} of the {}-byte budget are left ({} "
                              "bytes in use)",
                              bytes, options_.budget_bytes - std::min(mapped_, options_.budget_bytes),
                              options_.budget_bytes, used_));
  };
  // Checked before rounding: a size near 2^64 would wrap to 0.
  if (bytes > options_.budget_bytes || bytes > kMaxHostAllocation) return over_budget();
  const std::size_t reserved = round_up(bytes, options_.alignment);
  std::size_t offset = 0;
  Slab* slab = nullptr;
  for (auto& s : slabs_) {
    if (carve(*s, reserved, &offset)) {
      slab = s.get();
      break;
    }
  }
  if (!slab) {
    // What alloc_host really maps for n bytes: huge-page multiples from 2 MiB up.
    auto mapped_size = [](std::size_t n) {
      return n >= kHugePageSize ? round_up(n, kHugePageSize) : round_up(n, 4096);
    };
    // The slab to map: the usual size, a slab of its own for a large request,
    // or (when the usual size no longer fits) what is left of the budget, so a
    // budget that is not a multiple of the slab size can be used in full.
    auto choose = [&] {
      std::size_t want = reserved > options_.slab_bytes ? mapped_size(reserved) : options_.slab_bytes;
      const std::size_t left = options_.budget_bytes - std::min(mapped_, options_.budget_bytes);
      if (want > left && reserved <= options_.slab_bytes) {
        std::size_t fit = left >= kHugePageSize ? left / kHugePageSize * kHugePageSize : left / 4096 * 4096;
        want = std::max(mapped_size(reserved), fit);
      }
      return want;
    };
    std::size_t want = choose();
    if (mapped_ + want > options_.budget_bytes) {
      // Give back empty slabs before refusing.
      for (auto it = slabs_.begin(); it != slabs_.end();) {
        if ((*it)->used == 0) {
          mapped_ -= (*it)->mem.mapped_bytes;
          unmap_slab(**it);
          it = slabs_.erase(it);
        } else {
          ++it;
        }
      }
      want = choose();
    }
    if (mapped_ + want > options_.budget_bytes) return over_budget();
    std::unique_ptr<Slab> s;
    STRATA_RETURN_IF_ERROR(map_slab(want, &s));
    mapped_ += s->mem.mapped_bytes;
    if (!carve(*s, reserved, &offset)) {  // cannot happen: the slab is at least `reserved` bytes
      mapped_ -= s->mem.mapped_bytes;
      unmap_slab(*s);
      return Status(StatusCode::kInternal, "pinned pool: a fresh slab is too small");
    }
    slab = s.get();
    slabs_.push_back(std::move(s));
  }
  used_ += reserved;
  PinnedBuffer b;
  b.pool_ = this;
  b.ptr_ = static_cast<char*>(slab->mem.ptr) + offset;
  b.bytes_ = bytes;
  b.reserved_ = reserved;
  return b;
}

void PinnedPool::release(void* ptr, std::size_t reserved) {
  std::lock_guard<std::mutex> lock(mu_);
  auto p = reinterpret_cast<std::uintptr_t>(ptr);
  for (auto& s : slabs_) {
    auto base = reinterpret_cast<std::uintptr_t>(s->mem.ptr);
    if (p < base || p >= base + s->mem.mapped_bytes) continue;
    std::size_t off = p - base;
    auto it = s->free.emplace(off, reserved).first;
    // Coalesce with the neighbours.
    auto next = std::next(it);
    if (next != s->free.end() && it->first + it->second == next->first) {
      it->second += next->second;
      s->free.erase(next);
    }
    if (it != s->free.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        s->free.erase(it);
      }
    }
    s->used -= reserved;
    used_ -= reserved;
    // Slabs of their own (bigger than the usual size) go back at once: they
    // are unlikely to fit the next request and hold a lot of the budget.
    if (s->used == 0 && s->mem.mapped_bytes > options_.slab_bytes) {
      mapped_ -= s->mem.mapped_bytes;
      unmap_slab(*s);
      slabs_.erase(std::find(slabs_.begin(), slabs_.end(), s));
    }
    return;
  }
  log_error("pinned pool: released a buffer it does not own");
}

void PinnedPool::trim() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = slabs_.begin(); it != slabs_.end();) {
    if ((*it)->used == 0) {
      mapped_ -= (*it)->mem.mapped_bytes;
      unmap_slab(**it);
      it = slabs_.erase(it);
    } else {
      ++it;
    }
  }
}

std::size_t PinnedPool::mapped_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_;
}
std::size_t PinnedPool::used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_;
}
std::size_t PinnedPool::slab_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return slabs_.size();
}

}  // namespace strata::io
