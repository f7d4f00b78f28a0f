// Training data: a token file, split into training and validation parts, and
// the batches the trainer draws from it.
//
// Formats (DataFormat):
//   text  every byte of the file is one token (byte-level; vocab 256 is the
//         default and covers every byte);
//   u16   little-endian uint16 token ids, the file size a multiple of 2;
//   u32   little-endian uint32 token ids, the file size a multiple of 4.
// Every id must be < vocab: open() scans the whole file once and refuses the
// first id that is not, naming its byte offset.
//
// Loss mask (optional, DataOptions::loss_mask_path; tools/prepare_data.py
// writes it): one byte per token, 1 = the model is trained to predict this
// token, 0 = it is context only (a chat's system and user turns, a prompt).
// Masked tokens are still inputs; as targets they are ignored (the ops'
// negative targets). open() checks that the mask has exactly one byte per
// token and that every byte is 0 or 1, naming the first offset that is not.
//
// Reading. The file is memory-mapped read-only (MAP_SHARED, PROT_READ); the
// kernel pages it in and out, so a file larger than RAM works and only the
// pages a batch touches are resident. The scan in open() walks the mapping
// front to back with MADV_SEQUENTIAL, then switches to MADV_RANDOM.
//
// Split. With N tokens and val_fraction f, the last floor(N * f) tokens are the
// validation part, the rest the training part. Each part must hold at least
// one sequence of seq + 1 tokens (the inputs and their next-token targets),
// else open() fails saying how many tokens there are and how many are needed.
// f == 0: no validation part (val_batches() == 0).
//
// Training batches. The training part is cut into windows of seq + 1 tokens
// at stride seq (neighbours share one token: the last target of one window is
// the first input of the next), shifted per epoch by a pseudo-random offset
// within the slack left at the end. Sample s (s = step * samples_per_step +
// index) is window perm_e(s mod W) of epoch e = s / W, where W is the number
// of windows and perm_e a bijection of [0, W) keyed by (seed, e) (a 4-round
// Feistel network with cycle walking over counter-based splitmix64 rounds).
// So every window is seen once per epoch, and a sample depends only on
// (seed, step, index): a resumed job draws exactly what the killed one would
// have drawn; the data position is the step count.
//
// Validation batches. The validation part is cut into windows the same way
// (no shift); batch j holds windows j*B .. j*B + B - 1 (mod the window count).
// Always the same batches for the same file, seq and B.
//
// Documents (optional, DataOptions::documents_path; tools/prepare_data.py
// writes PREFIX.docs): little-endian uint64 token offsets where documents
// start, the first 0, strictly increasing, each below the token count. With
// it every window lies inside one document: a document of L tokens gives
// ceil((L - 1) / seq) windows (none when L < 2), its first at the document's
// start and each next seq further on (a document longer than seq + 1 tokens
// continues in its next window, which sees the tail only; with
// truncate_documents it gives its first window only); a window shorter
// than seq + 1 is padded at the end with token 0, its padded targets masked.
// With causal attention the padding is never attended to by a real token, so
// each window trains as the document alone would (Hugging Face's per-example,
// right-padded batches: TRL's SFT without packing). The split: the validation
// part begins at the first document starting at or after the token split
// above (a document straddling it is training data). Training and validation
// windows are drawn as above, with no per-epoch shift.
//
// Thread-safety: after open() the dataset is immutable; batch functions may
// be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace strata::train {

enum class DataFormat : uint8_t { kText, kU16, kU32 };
const char* data_format_name(DataFormat f);  // "text", "u16", "u32"
// kInvalidArgument naming the text otherwise.
Result<DataFormat> parse_data_format(std::string_view text);

struct DataOptions {
  std::string path;
  DataFormat format = DataFormat::kText;
  uint32_t vocab = 256;        // ids must be < vocab
  double val_fraction = 0.05;  // [0, 0.9]
  uint64_t seed = 1234;        // shuffling of training windows
  uint32_t seq = 256;          // T: tokens per sequence (windows hold T + 1)
  std::string loss_mask_path;  // "": every token is a target
  std::string documents_path;  // "": documents packed into one stream (see above)
  // By document: a document longer than seq + 1 tokens gives its first
  // window only (TRL's truncation at max_length = seq + 1), not the windows
  // of its tail too.
  bool truncate_documents = false;
};

class TokenDataset {
 public:
  // Opens and validates the file (read with pread, never mapped: a file
  // truncated in place mid-run gives kIoError naming it, not SIGBUS). Errors: kNotFound (missing file),
  // kPermission / kIoError (naming the path and errno text),
  // kInvalidArgument (empty file; size not a multiple of the token size;
  // an id >= vocab, naming its byte offset; a part shorter than one sequence;
  // options out of range).
  static Result<std::unique_ptr<TokenDataset>> open(const DataOptions& options);
  ~TokenDataset();
  TokenDataset(const TokenDataset&) = delete;
  TokenDataset& operator=(const TokenDataset&) = delete;

  const DataOptions& options() const { return options_; }
  uint64_t tokens() const { return tokens_; }
  uint64_t train_tokens() const { return train_tokens_; }
  uint64_t val_tokens() const { return tokens_ - train_tokens_; }
  uint64_t train_windows() const { return train_windows_; }
  uint64_t val_windows() const { return val_windows_; }

  // Token at index i of the whole file (no bounds check beyond an assert;
  // 0 if the file can no longer be read there). For tests and tools.
  uint32_t token(uint64_t i) const;
  // A CRC32C of the token bytes: all of them up to 256 MiB, else 256 blocks
  // of 64 KiB spread evenly over the file (a resume checks it: another file
  // of the same size at the same path is another run).
  Result<uint32_t> fingerprint() const;

  // The first token of training sample `s` (see the header comment).
  uint64_t train_sample_offset(uint64_t s) const;
  // Fills out[b * (seq+1) + t] for b < batch, t <= seq with samples
  // first_sample .. first_sample + batch - 1. out.size() must be batch*(seq+1)
  // (kInvalidArgument otherwise). Reads the file (one pread per sample);
  // kIoError if it shrank since open. A non-empty `mask` (same size) gets
  // the loss mask of the same positions (all 1 without a mask file).
  Status train_batch(uint64_t first_sample, uint32_t batch, std::span<int32_t> out,
                     std::span<uint8_t> mask = {}) const;
  // Validation batch j (see the header comment); kInvalidArgument when there
  // is no validation part.
  Status val_batch(uint64_t j, uint32_t batch, std::span<int32_t> out, std::span<uint8_t> mask = {}) const {
    return val_windows(j * batch, batch, out, mask);
  }
  // Validation windows first .. first + count - 1 (mod the window count):
  // rank r's share of global batch j is first = j * N * b + r * b, count b.
  Status val_windows(uint64_t first, uint32_t count, std::span<int32_t> out, std::span<uint8_t> mask = {}) const;
  // Whether windows may hold positions that are not targets (a loss mask
  // file, or documents' padding): the trainer then weighs micro-batches by
  // their counted targets.
  bool has_loss_mask() const { return mask_fd_ >= 0 || by_document(); }
  uint64_t masked_tokens() const { return masked_tokens_; }  // mask bytes that are 0
  bool by_document() const { return !options_.documents_path.empty(); }
  uint64_t documents() const { return documents_; }  // documents with a window (by_document)
  // Documents longer than seq + 1 tokens (by_document): continued in more
  // windows, or truncated (DataOptions::truncate_documents).
  uint64_t long_documents() const { return long_documents_; }
  // Padded positions of every training window (by_document), of
  // train_windows() * (seq + 1).
  uint64_t train_padding() const { return train_padding_; }
  // Number of distinct validation batches of size `batch`: ceil(windows / batch).
  uint64_t val_batches(uint32_t batch) const;

 private:
  TokenDataset() = default;
  uint64_t train_window(uint64_t s) const;  // training sample s's window
  // By open(), after the split: fills the windows; *starts gets the
  // documents' starts.
  Status load_documents(std::vector<uint64_t>* starts);
  // Window w of the whole file (training windows first): packed, seq + 1
  // tokens at `w * seq` past its part's start; by document, win_begin_[w].
  Status copy_window(uint64_t begin, uint64_t len, int32_t* out, uint8_t* mask) const;
  Status read_mask(uint64_t first, uint64_t count, uint8_t* dst) const;
  Status read_tokens(uint64_t first, uint64_t count, void* dst) const;  // pread, whole or an error

  DataOptions options_;
  int fd_ = -1;
  int mask_fd_ = -1;
  uint64_t masked_tokens_ = 0;
  uint32_t token_bytes_ = 1;
  uint64_t tokens_ = 0;
  uint64_t train_tokens_ = 0;
  uint64_t train_windows_ = 0;
  uint64_t val_windows_ = 0;
  // By document: each window's first token and length (<= seq + 1), the
  // training windows first.
  std::vector<uint64_t> win_begin_;
  std::vector<uint32_t> win_len_;
  uint64_t documents_ = 0, long_documents_ = 0, train_padding_ = 0;
};

// Counter-based pseudo-random numbers: splitmix64's finalizer over a key.
// Pure; the same (seed, a, b) always gives the same value.
uint64_t mix64(uint64_t x);
uint64_t counter_random(uint64_t seed, uint64_t a, uint64_t b);
// A bijection of [0, n) keyed by `key` (n >= 1): Feistel + cycle walking.
uint64_t permute_index(uint64_t i, uint64_t n, uint64_t key);

}  // namespace strata::train
