#include "train/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cassert>
#include <cerrno>
#include <cmath>
#include <cstring>

namespace strata::train {

const char* data_format_name(DataFormat f) {
  switch (f) {
    case DataFormat::kText: return "text";
    case DataFormat::kU16: return "u16";
    case DataFormat::kU32: return "u32";
  }
  return "?";
}

Result<DataFormat> parse_data_format(std::string_view text) {
  if (text == "text") return DataFormat::kText;
  if (text == "u16") return DataFormat::kU16;
  if (text == "u32") return DataFormat::kU32;
  return Status(StatusCode::kInvalidArgument,
                "data format \"" + std::string(text) + "\" is not one of text, u16, u32");
}

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t counter_random(uint64_t seed, uint64_t a, uint64_t b) { return mix64(mix64(mix64(seed) ^ a) ^ b); }

uint64_t permute_index(uint64_t i, uint64_t n, uint64_t key) {
  assert(n >= 1 && i < n);
  if (n == 1) return 0;
  // Smallest even bit count whose range covers n; halves of `half` bits.
  unsigned bits = 64 - static_cast<unsigned>(__builtin_clzll(n - 1));
  if (bits % 2) ++bits;
  const unsigned half = bits / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  // Cycle walking: the Feistel network permutes [0, 2^bits); applying it
  // until the value lands in [0, n) is a bijection of [0, n). The domain is
  // less than 4n, so a few iterations on average.
  uint64_t x = i;
  do {
    uint64_t l = x >> half, r = x & mask;
    for (uint64_t round = 0; round < 4; ++round) {
      const uint64_t f = counter_random(key, round, r) & mask;
      const uint64_t nl = r;
      r = l ^ f;
      l = nl;
    }
    x = (l << half) | r;
  } while (x >= n);
  return x;
}

TokenDataset::~TokenDataset() {
  if (map_) munmap(const_cast<uint8_t*>(map_), map_bytes_);
}

uint32_t TokenDataset::token(uint64_t i) const {
  assert(i < tokens_);
  switch (token_bytes_) {
    case 1: return map_[i];
    case 2: {
      uint16_t v;
      std::memcpy(&v, map_ + 2 * i, 2);
      return v;
    }
    default: {
      uint32_t v;
      std::memcpy(&v, map_ + 4 * i, 4);
      return v;
    }
  }
}

Result<std::unique_ptr<TokenDataset>> TokenDataset::open(const DataOptions& o) {
  const std::string& path = o.path;
  if (path.empty()) return Status(StatusCode::kInvalidArgument, "no data file given");
  if (o.vocab < 1) return Status(StatusCode::kInvalidArgument, "vocab must be at least 1");
  if (o.seq < 1) return Status(StatusCode::kInvalidArgument, "sequence length must be at least 1");
  if (!(o.val_fraction >= 0 && o.val_fraction <= 0.9))
    return Status(StatusCode::kInvalidArgument,
                  "validation fraction " + std::to_string(o.val_fraction) + " is outside [0, 0.9]");
  std::unique_ptr<TokenDataset> d(new TokenDataset());
  d->options_ = o;
  d->token_bytes_ = o.format == DataFormat::kText ? 1 : o.format == DataFormat::kU16 ? 2 : 4;

  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::from_errno(errno, "data file " + path + ": cannot open");
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::from_errno(err, "data file " + path + ": stat failed");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status(StatusCode::kInvalidArgument, "data file " + path + " is not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    return Status(StatusCode::kInvalidArgument, "data file " + path + " is empty");
  }
  if (size % d->token_bytes_ != 0) {
    ::close(fd);
    return Status(StatusCode::kInvalidArgument,
                  "data file " + path + ": " + std::to_string(size) + " bytes is not a whole number of " +
                      data_format_name(o.format) + " tokens (" + std::to_string(d->token_bytes_) +
                      " bytes each; " + std::to_string(size % d->token_bytes_) + " trailing bytes)");
  }
  void* m = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file
  if (m == MAP_FAILED) return Status::from_errno(map_err, "data file " + path + ": mmap of " +
                                                              std::to_string(size) + " bytes failed");
  d->map_ = static_cast<const uint8_t*>(m);
  d->map_bytes_ = size;
  d->tokens_ = size / d->token_bytes_;

  // One sequential pass checks every id; the page cache, not our heap, holds
  // the pages, and the kernel drops them as it likes.
  if (o.format != DataFormat::kText || o.vocab < 256) {
    madvise(m, size, MADV_SEQUENTIAL);
    for (uint64_t i = 0; i < d->tokens_; ++i) {
      const uint32_t t = d->token(i);
      if (t >= o.vocab)
        return Status(StatusCode::kInvalidArgument,
                      "data file " + path + ": token id " + std::to_string(t) + " at byte offset " +
                          std::to_string(i * d->token_bytes_) + " (token " + std::to_string(i) +
                          ") is not below the vocabulary size " + std::to_string(o.vocab));
    }
  }
  madvise(m, size, MADV_RANDOM);

  const uint64_t need = uint64_t{o.seq} + 1;
  const uint64_t val = static_cast<uint64_t>(std::floor(static_cast<double>(d->tokens_) * o.val_fraction));
  d->train_tokens_ = d->tokens_ - val;
  if (d->train_tokens_ < need)
    return Status(StatusCode::kInvalidArgument,
                  "data file " + path + " is too short: its training part holds " +
                      std::to_string(d->train_tokens_) + " tokens (of " + std::to_string(d->tokens_) +
                      "), one sequence needs " + std::to_string(need) + " (seq + 1); use a longer file or a "
                      "shorter --seq");
  if (o.val_fraction > 0 && val < need)
    return Status(StatusCode::kInvalidArgument,
                  "data file " + path + " is too short for a validation split: the last " +
                      std::to_string(o.val_fraction * 100) + "% is " + std::to_string(val) +
                      " tokens, one sequence needs " + std::to_string(need) +
                      "; raise --val-fraction, shorten --seq, or pass --val-fraction 0");
  d->train_windows_ = (d->train_tokens_ - 1) / o.seq;
  d->val_windows_ = val >= need ? (val - 1) / o.seq : 0;
  return d;
}

void TokenDataset::copy_window(uint64_t begin, int32_t* out) const {
  const uint64_t n = uint64_t{options_.seq} + 1;
  for (uint64_t t = 0; t < n; ++t) out[t] = static_cast<int32_t>(token(begin + t));
}

uint64_t TokenDataset::train_sample_offset(uint64_t s) const {
  const uint64_t w = train_windows_;
  const uint64_t epoch = s / w;
  const uint64_t key = counter_random(options_.seed, epoch, 0x5eed);
  const uint64_t window = permute_index(s % w, w, key);
  // Slack at the end of the training part: shifting every window by the same
  // amount in [0, slack] changes which token pairs share a window per epoch.
  const uint64_t slack = (train_tokens_ - 1) - w * options_.seq;
  const uint64_t shift = slack ? counter_random(options_.seed, epoch, 0x5417) % (slack + 1) : 0;
  return shift + window * options_.seq;
}

Status TokenDataset::train_batch(uint64_t first_sample, uint32_t batch, std::span<int32_t> out) const {
  const uint64_t n = uint64_t{options_.seq} + 1;
  if (out.size() != batch * n)
    return Status(StatusCode::kInvalidArgument, "train_batch: output holds " + std::to_string(out.size()) +
                                                    " tokens, batch needs " + std::to_string(batch * n));
  for (uint32_t b = 0; b < batch; ++b) copy_window(train_sample_offset(first_sample + b), out.data() + b * n);
  return {};
}

uint64_t TokenDataset::val_batches(uint32_t batch) const {
  if (batch == 0 || val_windows_ == 0) return 0;
  return (val_windows_ + batch - 1) / batch;
}

Status TokenDataset::val_batch(uint64_t j, uint32_t batch, std::span<int32_t> out) const {
  const uint64_t n = uint64_t{options_.seq} + 1;
  if (val_windows_ == 0)
    return Status(StatusCode::kInvalidArgument, "data file " + options_.path + " has no validation part");
  if (out.size() != batch * n)
    return Status(StatusCode::kInvalidArgument, "val_batch: output holds " + std::to_string(out.size()) +
                                                    " tokens, batch needs " + std::to_string(batch * n));
  for (uint32_t b = 0; b < batch; ++b) {
    const uint64_t w = (j * batch + b) % val_windows_;
    copy_window(train_tokens_ + w * options_.seq, out.data() + b * n);
  }
  return {};
}

}  // namespace strata::train
