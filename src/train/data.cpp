#include "train/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/crc32c.h"
#include "common/enum_names.h"

namespace strata {
template <>
inline constexpr auto kEnumNames<train::DataFormat> = std::to_array<EnumName<train::DataFormat>>(
    {{train::DataFormat::kText, "text"}, {train::DataFormat::kU16, "u16"}, {train::DataFormat::kU32, "u32"}});
}  // namespace strata

namespace strata::train {

const char* data_format_name(DataFormat f) { return enum_name(f); }

Result<DataFormat> parse_data_format(std::string_view text) {
  if (auto f = find_enum<DataFormat>(text)) return *f;
  return Status(StatusCode::kInvalidArgument,
                "data format \"" + std::string(text) + "\" is not one of " + enum_name_list<DataFormat>());
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
  if (fd_ >= 0) ::close(fd_);
  if (mask_fd_ >= 0) ::close(mask_fd_);
}

Status TokenDataset::read_mask(uint64_t first, uint64_t count, uint8_t* dst) const {
  uint64_t done = 0;
  while (done < count) {
    const ssize_t n = ::pread(mask_fd_, dst + done, count - done, static_cast<off_t>(first + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      return Status::from_errno(errno, "loss mask " + options_.loss_mask_path + ": read of " + std::to_string(count) +
                                           " bytes at offset " + std::to_string(first) + " failed");
    if (n == 0)
      return Status(StatusCode::kIoError, "loss mask " + options_.loss_mask_path + ": the file ends before byte " +
                                              std::to_string(first + count) + " (it shrank since it was opened)");
    done += static_cast<uint64_t>(n);
  }
  return {};
}

Status TokenDataset::read_tokens(uint64_t first, uint64_t count, void* dst) const {
  const uint64_t off = first * token_bytes_, bytes = count * token_bytes_;
  uint64_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd_, static_cast<uint8_t*>(dst) + done, bytes - done, static_cast<off_t>(off + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      return Status::from_errno(errno, "data file " + options_.path + ": read of " + std::to_string(bytes) +
                                           " bytes at offset " + std::to_string(off) + " failed");
    if (n == 0) {
      struct stat st {};
      const uint64_t now = ::fstat(fd_, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
      return Status(StatusCode::kIoError,
                    "data file " + options_.path + " shrank while in use: it was " +
                        std::to_string(tokens_ * token_bytes_) + " bytes at start, now " + std::to_string(now) +
                        " (a read at offset " + std::to_string(off + done) +
                        " found its end); was it truncated or rewritten in place?");
    }
    done += static_cast<uint64_t>(n);
  }
  return {};
}

Result<uint32_t> TokenDataset::fingerprint() const {
  constexpr uint64_t kWhole = uint64_t{256} << 20, kBlock = uint64_t{64} << 10, kBlocks = 256;
  const uint64_t bytes = tokens_ * token_bytes_;
  const uint64_t block_tokens = kBlock / token_bytes_;
  std::vector<uint8_t> buf(bytes <= kWhole ? std::min(bytes, kBlock) : kBlock);
  uint32_t crc = 0;
  auto add = [&](uint64_t first, uint64_t count) -> Status {
    STRATA_RETURN_IF_ERROR(read_tokens(first, count, buf.data()));
    crc = crc32c_extend(crc, buf.data(), count * token_bytes_);
    return {};
  };
  if (bytes <= kWhole) {
    for (uint64_t t = 0; t < tokens_; t += block_tokens) STRATA_RETURN_IF_ERROR(add(t, std::min(block_tokens, tokens_ - t)));
  } else {
    const uint64_t stride = (tokens_ - block_tokens) / (kBlocks - 1);
    for (uint64_t k = 0; k < kBlocks; ++k) STRATA_RETURN_IF_ERROR(add(k * stride, block_tokens));
  }
  return crc;
}

uint32_t TokenDataset::token(uint64_t i) const {
  assert(i < tokens_);
  uint32_t v = 0;
  if (!read_tokens(i, 1, &v).ok()) return 0;
  return token_bytes_ == 1 ? (v & 0xFFu) : token_bytes_ == 2 ? (v & 0xFFFFu) : v;  // little-endian
}

Status TokenDataset::load_documents(std::vector<uint64_t>* starts_out) {
  const std::string& dp = options_.documents_path;
  const int fd = ::open(dp.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Status::from_errno(errno, "documents " + dp + ": cannot open");
  std::vector<uint64_t> starts;
  Status st = [&]() -> Status {
    struct stat fs {};
    if (fstat(fd, &fs) != 0) return Status::from_errno(errno, "documents " + dp + ": stat failed");
    if (!S_ISREG(fs.st_mode)) return Status(StatusCode::kInvalidArgument, "documents " + dp + " is not a regular file");
    const uint64_t size = static_cast<uint64_t>(fs.st_size);
    if (size == 0 || size % 8 != 0)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("documents {}: {} bytes is not a non-empty list of uint64 offsets (8 bytes each; "
                                "tools/prepare_data.py writes it with the tokens)",
                                dp, size));
    if (size / 8 > tokens_)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("documents {} lists {} documents, more than the {} tokens of {}", dp, size / 8,
                                tokens_, options_.path));
    starts.resize(size / 8);
    uint64_t done = 0;
    while (done < size) {
      const ssize_t n = ::pread(fd, reinterpret_cast<uint8_t*>(starts.data()) + done, size - done,
                                static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Status::from_errno(errno, "documents " + dp + ": read failed");
      if (n == 0) return Status(StatusCode::kIoError, "documents " + dp + " shrank while it was read");
      done += static_cast<uint64_t>(n);
    }
    return {};
  }();
  ::close(fd);
  STRATA_RETURN_IF_ERROR(st);
  if (starts[0] != 0)
    return Status(StatusCode::kInvalidArgument,
                  fmt::format("documents {}: the first document starts at token {}, not 0", dp, starts[0]));
  for (size_t i = 1; i < starts.size(); ++i) {
    if (starts[i] <= starts[i - 1] || starts[i] >= tokens_)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("documents {}: entry {} (byte {}) is token {}; each start must be greater than the "
                                "one before ({}) and below the {} tokens of {}",
                                dp, i, i * 8, starts[i], starts[i - 1], tokens_, options_.path));
  }
  // The validation part begins at the first document at or after the split.
  const size_t first_val = static_cast<size_t>(std::lower_bound(starts.begin(), starts.end(), train_tokens_) -
                                               starts.begin());
  train_tokens_ = first_val < starts.size() ? starts[first_val] : tokens_;
  const uint64_t n = uint64_t{options_.seq} + 1;
  for (size_t i = 0; i < starts.size(); ++i) {
    const uint64_t end = i + 1 < starts.size() ? starts[i + 1] : tokens_;
    if (end - starts[i] < 2) continue;  // no target
    ++documents_;
    if (end - starts[i] > n) ++long_documents_;
    const uint64_t last = options_.truncate_documents ? std::min(end, starts[i] + n) : end;
    for (uint64_t b = starts[i]; b + 1 < last; b += options_.seq) {
      const uint64_t len = std::min(n, last - b);
      win_begin_.push_back(b);
      win_len_.push_back(static_cast<uint32_t>(len));
      if (i < first_val) {
        ++train_windows_;
        train_padding_ += n - len;
      } else {
        ++val_windows_;
      }
    }
  }
  *starts_out = std::move(starts);
  return {};
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

  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer
  // forever; it is refused below as not a regular file.
  d->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (d->fd_ < 0) return Status::from_errno(errno, "data file " + path + ": cannot open");
  struct stat st {};
  if (fstat(d->fd_, &st) != 0) return Status::from_errno(errno, "data file " + path + ": stat failed");
  if (!S_ISREG(st.st_mode))
    return Status(StatusCode::kInvalidArgument, "data file " + path + " is not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size == 0) return Status(StatusCode::kInvalidArgument, "data file " + path + " is empty");
  if (size % d->token_bytes_ != 0) {
    return Status(StatusCode::kInvalidArgument,
                  "data file " + path + ": " + std::to_string(size) + " bytes is not a whole number of " +
                      data_format_name(o.format) + " tokens (" + std::to_string(d->token_bytes_) +
                      " bytes each; " + std::to_string(size % d->token_bytes_) + " trailing bytes)");
  }
  d->tokens_ = size / d->token_bytes_;

  // Read, not mapped: a file truncated while mapped kills the process with
  // SIGBUS; a short read is an error naming the file. One sequential pass
  // checks every id through a bounded buffer.
  if (o.format != DataFormat::kText || o.vocab < 256) {
    posix_fadvise(d->fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
    constexpr uint64_t kChunk = 1 << 18;  // tokens per read
    std::vector<uint32_t> buf(kChunk);
    for (uint64_t first = 0; first < d->tokens_; first += kChunk) {
      const uint64_t n = std::min(kChunk, d->tokens_ - first);
      STRATA_RETURN_IF_ERROR(d->read_tokens(first, n, buf.data()));
      for (uint64_t k = 0; k < n; ++k) {
        const uint8_t* b = reinterpret_cast<const uint8_t*>(buf.data()) + k * d->token_bytes_;
        uint32_t t = 0;
        std::memcpy(&t, b, d->token_bytes_);  // little-endian, as written
        if (t >= o.vocab) {
          const uint64_t i = first + k;
          return Status(StatusCode::kInvalidArgument,
                        "data file " + path + ": token id " + std::to_string(t) + " at byte offset " +
                            std::to_string(i * d->token_bytes_) + " (token " + std::to_string(i) +
                            ") is not below the vocabulary size " + std::to_string(o.vocab));
        }
      }
    }
  }
  posix_fadvise(d->fd_, 0, 0, POSIX_FADV_RANDOM);

  // The split: the last floor(tokens x val_fraction) tokens are held out.
  d->train_tokens_ =
      d->tokens_ - static_cast<uint64_t>(std::floor(static_cast<double>(d->tokens_) * o.val_fraction));
  // By document, a document's first token is no target (nor the one token
  // of a 1-token document): the mask check below skips the starts.
  std::vector<uint64_t> starts;
  if (o.truncate_documents && o.documents_path.empty())
    return Status(StatusCode::kInvalidArgument,
                  "truncating documents (--truncate-documents) needs their starts (--documents)");
  if (!o.documents_path.empty()) STRATA_RETURN_IF_ERROR(d->load_documents(&starts));

  if (!o.loss_mask_path.empty()) {
    const std::string& mp = o.loss_mask_path;
    d->mask_fd_ = ::open(mp.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (d->mask_fd_ < 0) return Status::from_errno(errno, "loss mask " + mp + ": cannot open");
    struct stat ms {};
    if (fstat(d->mask_fd_, &ms) != 0) return Status::from_errno(errno, "loss mask " + mp + ": stat failed");
    if (!S_ISREG(ms.st_mode)) return Status(StatusCode::kInvalidArgument, "loss mask " + mp + " is not a regular file");
    if (static_cast<uint64_t>(ms.st_size) != d->tokens_)
      return Status(StatusCode::kInvalidArgument,
                    "loss mask " + mp + " has " + std::to_string(ms.st_size) + " bytes but data file " + path +
                        " holds " + std::to_string(d->tokens_) + " tokens: a mask has one byte per token (written "
                        "together by tools/prepare_data.py)");
    constexpr uint64_t kChunk = 1 << 20;
    std::vector<uint8_t> buf(std::min<uint64_t>(kChunk, d->tokens_));
    uint64_t ones = 0;
    // Targets (a window's tokens after its first) in the training part and
    // in the held-out part.
    const uint64_t train_end = d->train_tokens_;
    uint64_t train_ones = 0, val_ones = 0;
    size_t next_start = 0;  // by document: the first start not yet passed
    for (uint64_t first = 0; first < d->tokens_; first += kChunk) {
      const uint64_t n = std::min(kChunk, d->tokens_ - first);
      STRATA_RETURN_IF_ERROR(d->read_mask(first, n, buf.data()));
      for (uint64_t k = 0; k < n; ++k) {
        const uint64_t i = first + k;
        if (buf[k] > 1)
          return Status(StatusCode::kInvalidArgument, "loss mask " + mp + ": byte " + std::to_string(i) +
                                                          " is " + std::to_string(buf[k]) + "; expected 0 or 1");
        ones += buf[k];
        if (next_start < starts.size() && starts[next_start] == i) {
          ++next_start;
          continue;  // a document's first token: never a target
        }
        if (o.truncate_documents && next_start > 0 && i - starts[next_start - 1] > o.seq)
          continue;  // past a truncated document's window
        if (i >= 1 && i < train_end) train_ones += buf[k];
        if (i > train_end) val_ones += buf[k];
      }
    }
    d->masked_tokens_ = d->tokens_ - ones;
    if (ones == 0)
      return Status(StatusCode::kInvalidArgument,
                    "loss mask " + mp + " masks every token: there is nothing to train on");
    // Otherwise every step would report loss 0 and train on nothing.
    if (train_ones == 0)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("loss mask {} marks no target in the training part (tokens 0 to {}; the last {} "
                                "are held out by --val-fraction {:g}{}): there is nothing to train on",
                                mp, train_end, d->tokens_ - train_end, o.val_fraction,
                                starts.empty() ? "" : "; by document, a document's first token is no target"));
    if (train_end < d->tokens_ && val_ones == 0)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("loss mask {} marks no target in the validation part (the last {} tokens, held out "
                                "by --val-fraction {:g}{}): its loss would be over nothing; use --val-fraction 0 or "
                                "data whose end has trained tokens",
                                mp, d->tokens_ - train_end, o.val_fraction,
                                starts.empty() ? "" : "; by document, a document's first token is no target"));
  }

  const uint64_t need = uint64_t{o.seq} + 1;
  const uint64_t val = d->tokens_ - d->train_tokens_;
  if (d->by_document()) {
    if (d->train_windows_ == 0)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("documents {}: no document in the training part (tokens 0 to {}) holds 2 tokens or "
                                "more: there is nothing to train on",
                                o.documents_path, d->train_tokens_));
    if (o.val_fraction > 0 && d->val_windows_ == 0)
      return Status(StatusCode::kInvalidArgument,
                    fmt::format("documents {}: no document of 2 tokens or more starts in the last {:g}% of {} (the "
                                "validation part; a document straddling the split is training data); raise "
                                "--val-fraction or pass --val-fraction 0",
                                o.documents_path, o.val_fraction * 100, path));
    return d;
  }
  if (d->train_tokens_ < need)
    return Status(StatusCode::kInvalidArgument,
                  "data file " + path + " is too short: its training part holds " +
                      std::to_string(d->train_tokens_) + " tokens (of " + std::to_string(d->tokens_) +
                      "), one sequence needs " + std::to_string(need) + " (seq + 1); use a longer file or a "
                      "shorter --seq");
  if (o.val_fraction > 0 && val < need)
    return Status(StatusCode::kInvalidArgument,
                  "data file " + path + " is too short for a validation split: the last " +
                      fmt::format("{:g}", o.val_fraction * 100) + "% is " + std::to_string(val) +
                      " tokens, one sequence needs " + std::to_string(need) +
                      "; raise --val-fraction, shorten --seq, or pass --val-fraction 0");
  d->train_windows_ = (d->train_tokens_ - 1) / o.seq;
  d->val_windows_ = val >= need ? (val - 1) / o.seq : 0;
  return d;
}

Status TokenDataset::copy_window(uint64_t begin, uint64_t len, int32_t* out, uint8_t* mask) const {
  const uint64_t n = uint64_t{options_.seq} + 1;
  assert(len >= 1 && len <= n);
  if (mask) {
    if (mask_fd_ >= 0)
      STRATA_RETURN_IF_ERROR(read_mask(begin, len, mask));
    else
      std::memset(mask, 1, len);
    std::memset(mask + len, 0, n - len);  // padding: no target
  }
  // Read the ids into the tail of `out`'s first len slots, then widen
  // forward in place: id t moves from byte len*(4-b) + t*b to byte 4t, never
  // past an unread id.
  uint8_t* bytes = reinterpret_cast<uint8_t*>(out);
  const uint64_t src = len * (4 - token_bytes_);
  STRATA_RETURN_IF_ERROR(read_tokens(begin, len, bytes + src));
  for (uint64_t t = 0; t < len; ++t) {
    uint32_t v = 0;
    std::memcpy(&v, bytes + src + t * token_bytes_, token_bytes_);
    out[t] = static_cast<int32_t>(v);
  }
  std::fill(out + len, out + n, 0);  // padding after the last token: never attended to by a real one
  return {};
}

uint64_t TokenDataset::train_window(uint64_t s) const {
  const uint64_t w = train_windows_;
  const uint64_t epoch = s / w;
  const uint64_t key = counter_random(options_.seed, epoch, 0x5eed);
  return permute_index(s % w, w, key);
}

uint64_t TokenDataset::train_sample_offset(uint64_t s) const {
  const uint64_t w = train_windows_;
  const uint64_t epoch = s / w;
  const uint64_t window = train_window(s);
  if (by_document()) return win_begin_[window];
  // Slack at the end of the training part: shifting every window by the same
  // amount in [0, slack] changes which token pairs share a window per epoch.
  const uint64_t slack = (train_tokens_ - 1) - w * options_.seq;
  const uint64_t shift = slack ? counter_random(options_.seed, epoch, 0x5417) % (slack + 1) : 0;
  return shift + window * options_.seq;
}

Status TokenDataset::train_batch(uint64_t first_sample, uint32_t batch, std::span<int32_t> out,
                                 std::span<uint8_t> mask) const {
  const uint64_t n = uint64_t{options_.seq} + 1;
  if (out.size() != batch * n || (!mask.empty() && mask.size() != out.size()))
    return Status(StatusCode::kInvalidArgument, "train_batch: output holds " + std::to_string(out.size()) +
                                                    " tokens (mask " + std::to_string(mask.size()) +
                                                    "), batch needs " + std::to_string(batch * n));
  for (uint32_t b = 0; b < batch; ++b) {
    uint64_t begin = 0, len = n;
    if (by_document()) {
      const uint64_t w = train_window(first_sample + b);
      begin = win_begin_[w];
      len = win_len_[w];
    } else {
      begin = train_sample_offset(first_sample + b);
    }
    STRATA_RETURN_IF_ERROR(
        copy_window(begin, len, out.data() + b * n, mask.empty() ? nullptr : mask.data() + b * n));
  }
  return {};
}

uint64_t TokenDataset::val_batches(uint32_t batch) const {
  if (batch == 0 || val_windows_ == 0) return 0;
  return (val_windows_ + batch - 1) / batch;
}

Status TokenDataset::val_windows(uint64_t first, uint32_t batch, std::span<int32_t> out,
                                 std::span<uint8_t> mask) const {
  const uint64_t n = uint64_t{options_.seq} + 1;
  if (val_windows_ == 0)
    return Status(StatusCode::kInvalidArgument, "data file " + options_.path + " has no validation part");
  if (out.size() != batch * n || (!mask.empty() && mask.size() != out.size()))
    return Status(StatusCode::kInvalidArgument, "val_windows: output holds " + std::to_string(out.size()) +
                                                    " tokens, batch needs " + std::to_string(batch * n));
  for (uint32_t b = 0; b < batch; ++b) {
    const uint64_t w = (first + b) % val_windows_;
    const uint64_t begin = by_document() ? win_begin_[train_windows_ + w] : train_tokens_ + w * options_.seq;
    const uint64_t len = by_document() ? win_len_[train_windows_ + w] : n;
    STRATA_RETURN_IF_ERROR(
        copy_window(begin, len, out.data() + b * n, mask.empty() ? nullptr : mask.data() + b * n));
  }
  return {};
}

}  // namespace strata::train
