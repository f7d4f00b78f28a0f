// The token data set: formats, validation of ids and sizes, the split, and
// the deterministic shuffled batches (data.h). Small files under
// STRATA_TEST_DIR (else /tmp), removed at the end.
#include "train/data.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace strata::train {
namespace {

namespace fs = std::filesystem;

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* env = std::getenv("STRATA_TEST_DIR");
    std::string tmpl = std::string(env && *env ? env : "/tmp") + "/strata-data-test-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    ASSERT_NE(mkdtemp(buf.data()), nullptr);
    dir_ = buf.data();
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string write(const std::string& name, const void* data, size_t bytes) {
    std::string p = dir_ + "/" + name;
    std::ofstream f(p, std::ios::binary);
    f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    return p;
  }
  std::string dir_;
};

TEST_F(DataTest, TextTokensAreBytes) {
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>(i * 7 % 256);
  DataOptions o;
  o.path = write("a.txt", text.data(), text.size());
  o.seq = 16;
  o.val_fraction = 0.1;
  auto d = TokenDataset::open(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ((*d)->tokens(), 1000u);
  EXPECT_EQ((*d)->val_tokens(), 100u);
  EXPECT_EQ((*d)->train_tokens(), 900u);
  EXPECT_EQ((*d)->train_windows(), (900u - 1) / 16);
  EXPECT_EQ((*d)->val_windows(), (100u - 1) / 16);
  for (uint64_t i = 0; i < 1000; ++i) ASSERT_EQ((*d)->token(i), static_cast<uint8_t>(text[i]));
  // A training batch: each row is seq+1 consecutive file tokens inside the training part.
  std::vector<int32_t> batch(4 * 17);
  ASSERT_TRUE((*d)->train_batch(5, 4, batch).ok());
  for (uint32_t b = 0; b < 4; ++b) {
    const uint64_t off = (*d)->train_sample_offset(5 + b);
    ASSERT_LE(off + 17, 900u);
    for (uint32_t t = 0; t < 17; ++t) EXPECT_EQ(batch[b * 17 + t], static_cast<uint8_t>(text[off + t]));
  }
  // Validation batches come from the last 100 tokens, at stride seq, and never change.
  std::vector<int32_t> v1(2 * 17), v2(2 * 17);
  ASSERT_EQ((*d)->val_batches(2), 3u);  // 6 windows / 2
  ASSERT_TRUE((*d)->val_batch(1, 2, v1).ok());
  ASSERT_TRUE((*d)->val_batch(1, 2, v2).ok());
  EXPECT_EQ(v1, v2);
  for (uint32_t t = 0; t < 17; ++t) EXPECT_EQ(v1[t], static_cast<uint8_t>(text[900 + 2 * 16 + t]));
  // Wrong output size.
  std::vector<int32_t> small(10);
  EXPECT_EQ((*d)->train_batch(0, 4, small).code(), StatusCode::kInvalidArgument);
}

TEST_F(DataTest, U16AndU32WithVocab) {
  std::vector<uint16_t> ids16(300);
  for (size_t i = 0; i < ids16.size(); ++i) ids16[i] = static_cast<uint16_t>((i * 131) % 50000);
  DataOptions o;
  o.path = write("a.u16", ids16.data(), ids16.size() * 2);
  o.format = DataFormat::kU16;
  o.vocab = 50000;
  o.seq = 8;
  auto d = TokenDataset::open(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ((*d)->tokens(), 300u);
  for (size_t i = 0; i < ids16.size(); ++i) ASSERT_EQ((*d)->token(i), ids16[i]);

  std::vector<uint32_t> ids32(300);
  for (size_t i = 0; i < ids32.size(); ++i) ids32[i] = static_cast<uint32_t>((i * 7919) % 150000);
  o.path = write("a.u32", ids32.data(), ids32.size() * 4);
  o.format = DataFormat::kU32;
  o.vocab = 150000;
  d = TokenDataset::open(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  for (size_t i = 0; i < ids32.size(); ++i) ASSERT_EQ((*d)->token(i), ids32[i]);

  // An id at the vocabulary size is refused, naming its byte offset.
  ids32[123] = 150000;
  o.path = write("b.u32", ids32.data(), ids32.size() * 4);
  d = TokenDataset::open(o);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("byte offset 492"), std::string::npos) << d.status().message();
  EXPECT_NE(d.status().message().find("150000"), std::string::npos);

  // Text with a vocabulary below 256: bytes at or above it are refused too.
  std::string text = "hello world, this is a test of the text format ok";
  text[20] = static_cast<char>(200);
  o.path = write("c.txt", text.data(), text.size());
  o.format = DataFormat::kText;
  o.vocab = 128;
  o.val_fraction = 0;
  d = TokenDataset::open(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("byte offset 20"), std::string::npos) << d.status().message();
}

TEST_F(DataTest, Errors) {
  DataOptions o;
  o.seq = 8;
  o.path = dir_ + "/missing.txt";
  auto d = TokenDataset::open(o);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), StatusCode::kNotFound);
  EXPECT_NE(d.status().message().find("missing.txt"), std::string::npos);

  o.path = write("empty.txt", "", 0);
  d = TokenDataset::open(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("is empty"), std::string::npos) << d.status().message();

  o.path = write("short.txt", "abcdefgh", 8);  // 8 tokens, one sequence needs 9
  o.val_fraction = 0;
  d = TokenDataset::open(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("too short"), std::string::npos) << d.status().message();
  EXPECT_NE(d.status().message().find("needs 9"), std::string::npos) << d.status().message();

  // Long enough to train on but not for the validation split asked for.
  std::string t(100, 'x');
  o.path = write("t.txt", t.data(), t.size());
  o.val_fraction = 0.05;  // 5 tokens
  d = TokenDataset::open(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("validation"), std::string::npos) << d.status().message();
  o.val_fraction = 0;
  d = TokenDataset::open(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ((*d)->val_batches(4), 0u);
  std::vector<int32_t> v(4 * 9);
  EXPECT_FALSE((*d)->val_batch(0, 4, v).ok());

  // u16 file with an odd byte count.
  o.format = DataFormat::kU16;
  o.path = write("odd.u16", t.data(), 99);
  d = TokenDataset::open(o);
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("1 trailing bytes"), std::string::npos) << d.status().message();

  // A directory is not a data file.
  o.path = dir_;
  EXPECT_FALSE(TokenDataset::open(o).ok());
  o.format = DataFormat::kText;
  o.path = write("u.txt", t.data(), t.size());
  o.val_fraction = 0.95;
  EXPECT_FALSE(TokenDataset::open(o).ok());
  EXPECT_FALSE(parse_data_format("u8").ok());
  EXPECT_EQ(parse_data_format("u32").value(), DataFormat::kU32);
}

// Issue 10: a FIFO given as data used to block forever at open; a data file
// truncated in place mid-run killed the process with SIGBUS (it was mapped).
TEST_F(DataTest, FifoIsRefusedAndTruncationIsAnError) {
  DataOptions o;
  o.seq = 8;
  o.val_fraction = 0;
  o.path = dir_ + "/fifo";
  ASSERT_EQ(mkfifo(o.path.c_str(), 0600), 0);
  auto d = TokenDataset::open(o);  // returns at once (no writer needed)
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("is not a regular file"), std::string::npos) << d.status().message();

  std::string t(4096, 'y');
  o.path = write("shrinks.txt", t.data(), t.size());
  d = TokenDataset::open(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  std::vector<int32_t> out(4 * 9);
  ASSERT_TRUE((*d)->train_batch(0, 4, out).ok());
  ASSERT_EQ(truncate(o.path.c_str(), 0), 0);
  Status st;
  for (uint64_t s = 0; s < 64 && st.ok(); s += 4) st = (*d)->train_batch(s, 4, out);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_NE(st.message().find("shrank while in use"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("shrinks.txt"), std::string::npos) << st.message();
}

TEST_F(DataTest, LossMaskComesWithItsWindowsAndBadMasksAreRefused) {
  std::vector<uint32_t> ids(200);
  std::vector<uint8_t> mask(200);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint32_t>(i), mask[i] = (i / 3) % 2;
  DataOptions o;
  o.path = write("t.u32", ids.data(), ids.size() * 4);
  o.format = DataFormat::kU32;
  o.vocab = 1000;
  o.seq = 8;
  o.val_fraction = 0.2;
  o.loss_mask_path = write("t.mask", mask.data(), mask.size());
  auto d = TokenDataset::open(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_TRUE((*d)->has_loss_mask());
  EXPECT_EQ((*d)->masked_tokens(), 101u);  // (i / 3) % 2 == 0 for 101 of 0..199
  std::vector<int32_t> tok(2 * 9);
  std::vector<uint8_t> m(2 * 9, 7);
  for (uint64_t s = 0; s < 20; ++s) {
    ASSERT_TRUE((*d)->train_batch(s, 2, tok, m).ok());
    for (size_t k = 0; k < tok.size(); ++k) ASSERT_EQ(m[k], mask[static_cast<size_t>(tok[k])]) << "sample " << s;
  }
  ASSERT_TRUE((*d)->val_batch(0, 2, tok, m).ok());
  for (size_t k = 0; k < tok.size(); ++k) ASSERT_EQ(m[k], mask[static_cast<size_t>(tok[k])]);
  // Without a mask file every position is a target.
  o.loss_mask_path.clear();
  d = TokenDataset::open(o);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE((*d)->train_batch(0, 2, tok, m).ok());
  EXPECT_TRUE(std::all_of(m.begin(), m.end(), [](uint8_t v) { return v == 1; }));

  auto refused = [&](const std::string& mask_path, const std::string& needle) {
    DataOptions b = o;
    b.loss_mask_path = mask_path;
    auto r = TokenDataset::open(b);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  refused(write("short.mask", mask.data(), 199), "199 bytes but data file");
  std::vector<uint8_t> two = mask;
  two[57] = 2;
  refused(write("two.mask", two.data(), two.size()), "byte 57 is 2");
  std::vector<uint8_t> zeros(200, 0);
  refused(write("zero.mask", zeros.data(), zeros.size()), "masks every token");
  refused(dir_ + "/missing.mask", "cannot open");
  const std::string fifo = dir_ + "/fifo.mask";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  refused(fifo, "not a regular file");
}

TEST_F(DataTest, DocumentsGiveWindowsInsideOneDocumentPadded) {
  // Token i of the file is i (so a window shows where it came from). The
  // documents: [0, 5), [5, 6) (one token: no target, no window), [6, 30)
  // (longer than seq + 1 = 9: windows at 6, 14, 22), [30, 40), [40, 47)
  // and [47, 60); the split at 60 - floor(60 x 0.25) = 45 falls inside
  // [40, 47), which stays training data: validation is [47, 60).
  std::vector<uint32_t> ids(60);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint32_t>(i);
  std::vector<uint8_t> mask(60, 1);
  mask[8] = 0;
  const std::vector<uint64_t> starts = {0, 5, 6, 30, 40, 47};
  DataOptions o;
  o.path = write("d.u32", ids.data(), ids.size() * 4);
  o.format = DataFormat::kU32;
  o.vocab = 100;
  o.seq = 8;
  o.val_fraction = 0.25;
  o.documents_path = write("d.docs", starts.data(), starts.size() * 8);
  o.loss_mask_path = write("d.mask", mask.data(), mask.size());
  auto d = TokenDataset::open(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_TRUE((*d)->by_document());
  EXPECT_TRUE((*d)->has_loss_mask());  // padding is not a target
  EXPECT_EQ((*d)->documents(), 5u);
  EXPECT_EQ((*d)->train_tokens(), 47u);
  // Training windows (begin, length): (0,5) (6,9) (14,9) (22,8) (30,9) (38,2) (40,7); validation (47,9) (55,5).
  const std::vector<std::pair<int, int>> want = {{0, 5}, {6, 9}, {14, 9}, {22, 8}, {30, 9}, {38, 2}, {40, 7}};
  ASSERT_EQ((*d)->train_windows(), want.size());
  EXPECT_EQ((*d)->val_windows(), 2u);
  EXPECT_EQ((*d)->train_padding(), 4u + 0 + 0 + 1 + 0 + 7 + 2);
  std::set<int> seen;
  std::vector<int32_t> tok(9);
  std::vector<uint8_t> m(9);
  for (uint64_t s = 0; s < want.size(); ++s) {  // one epoch: every window once
    ASSERT_TRUE((*d)->train_batch(s, 1, tok, m).ok());
    const auto it = std::find_if(want.begin(), want.end(), [&](auto w) { return w.first == tok[0]; });
    ASSERT_NE(it, want.end()) << "sample " << s << " starts at " << tok[0];
    EXPECT_EQ((*d)->train_sample_offset(s), static_cast<uint64_t>(tok[0]));
    seen.insert(tok[0]);
    for (int t = 0; t < 9; ++t) {
      if (t < it->second) {
        EXPECT_EQ(tok[t], it->first + t);
        EXPECT_EQ(m[t], it->first + t == 8 ? 0 : 1);
      } else {
        EXPECT_EQ(tok[t], 0) << "padding";
        EXPECT_EQ(m[t], 0) << "padding is no target";
      }
    }
  }
  EXPECT_EQ(seen.size(), want.size());
  std::vector<int32_t> vt(2 * 9);
  std::vector<uint8_t> vm(2 * 9);
  ASSERT_TRUE((*d)->val_batch(0, 2, vt, vm).ok());
  EXPECT_EQ(vt[0], 47);
  EXPECT_EQ(vt[8], 55);
  EXPECT_EQ(vt[9], 55);
  EXPECT_EQ(vt[13], 59);
  EXPECT_EQ(vt[14], 0);
  EXPECT_EQ(vm[14], 0);

  // Without a mask file the padding is still no target.
  o.loss_mask_path.clear();
  d = TokenDataset::open(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_TRUE((*d)->has_loss_mask());
  ASSERT_TRUE((*d)->val_batch(0, 2, vt, vm).ok());
  EXPECT_EQ(std::count(vm.begin(), vm.end(), 1), 9 + 5);
  EXPECT_EQ((*d)->long_documents(), 3u);  // [6, 30), [30, 40), [47, 60)

  // Truncated (TRL's max_length = seq + 1): each document's first window only.
  o.truncate_documents = true;
  d = TokenDataset::open(o);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ((*d)->train_windows(), 4u);  // (0,5) (6,9) (30,9) (40,7)
  EXPECT_EQ((*d)->val_windows(), 1u);    // (47,9)
  std::set<int> firsts;
  for (uint64_t s = 0; s < 4; ++s) {
    ASSERT_TRUE((*d)->train_batch(s, 1, tok, m).ok());
    firsts.insert(tok[0]);
  }
  EXPECT_EQ(firsts, (std::set<int>{0, 6, 30, 40}));
  o.truncate_documents = false;

  auto refused = [&](const std::vector<uint64_t>& docs, double val, const std::string& needle) {
    DataOptions b = o;
    b.val_fraction = val;
    b.documents_path = write("bad.docs", docs.data(), docs.size() * 8);
    auto r = TokenDataset::open(b);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  // A mask whose only targets are documents' first tokens trains on nothing by document.
  {
    std::vector<uint8_t> firsts(60, 0);
    for (uint64_t st : starts) firsts[st] = 1;
    DataOptions b = o;
    b.loss_mask_path = write("firsts.mask", firsts.data(), firsts.size());
    auto r = TokenDataset::open(b);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("marks no target in the training part"), std::string::npos)
        << r.status().message();
    EXPECT_NE(r.status().message().find("a document's first token is no target"), std::string::npos);
  }
  refused({1, 5}, 0, "the first document starts at token 1");
  {
    DataOptions b = o;
    b.documents_path.clear();
    b.truncate_documents = true;
    auto r = TokenDataset::open(b);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("needs their starts (--documents)"), std::string::npos);
  }
  refused({0, 5, 5}, 0, "entry 2 (byte 16) is token 5");
  refused({0, 60}, 0, "below the 60 tokens");
  refused({0, 12}, 0.1, "no document of 2 tokens or more starts in the last 10%");
  refused({}, 0, "0 bytes is not a non-empty list");
  std::vector<uint64_t> singles(60);
  for (size_t i = 0; i < singles.size(); ++i) singles[i] = i;
  refused(singles, 0, "no document in the training part");
  std::vector<uint64_t> too_many(61, 0);
  refused(too_many, 0, "lists 61 documents, more than the 60 tokens");
}

TEST(DataShuffle, PermuteIndexIsABijection) {
  for (uint64_t n : {1ull, 2ull, 3ull, 7ull, 64ull, 1000ull, 4097ull}) {
    for (uint64_t key : {0ull, 1ull, 0xdeadbeefull}) {
      std::set<uint64_t> seen;
      for (uint64_t i = 0; i < n; ++i) {
        const uint64_t p = permute_index(i, n, key);
        ASSERT_LT(p, n);
        seen.insert(p);
      }
      EXPECT_EQ(seen.size(), n) << "n=" << n << " key=" << key;
    }
  }
  // Different keys give different orders (n large enough that a clash is 1/1000!).
  int same = 0;
  for (uint64_t i = 0; i < 1000; ++i) same += permute_index(i, 1000, 1) == permute_index(i, 1000, 2);
  EXPECT_LT(same, 50);
}

TEST_F(DataTest, SamplesDependOnlyOnSeedAndIndex) {
  std::string text;
  for (int i = 0; i < 5000; ++i) text += static_cast<char>('a' + (i * 31 + i / 7) % 26);
  DataOptions o;
  o.path = write("s.txt", text.data(), text.size());
  o.seq = 32;
  o.val_fraction = 0.1;
  o.seed = 42;
  auto a = TokenDataset::open(o);
  auto b = TokenDataset::open(o);
  ASSERT_TRUE(a.ok() && b.ok());
  // Drawing in a different order (as after a resume) gives the same samples.
  for (uint64_t s = 300; s > 0; --s) ASSERT_EQ((*a)->train_sample_offset(s - 1), (*b)->train_sample_offset(s - 1));
  // One epoch covers every window once: offsets within an epoch are distinct
  // and share the epoch's shift (offset mod seq).
  const uint64_t w = (*a)->train_windows();
  for (uint64_t epoch = 0; epoch < 3; ++epoch) {
    std::set<uint64_t> offs;
    for (uint64_t i = 0; i < w; ++i) offs.insert((*a)->train_sample_offset(epoch * w + i));
    EXPECT_EQ(offs.size(), w);
    const uint64_t shift = *offs.begin() % o.seq;
    for (uint64_t off : offs) {
      EXPECT_EQ(off % o.seq, shift);
      EXPECT_LE(off + o.seq + 1, (*a)->train_tokens());
    }
  }
  // Another seed shuffles differently.
  o.seed = 43;
  auto c = TokenDataset::open(o);
  ASSERT_TRUE(c.ok());
  int same = 0;
  for (uint64_t s = 0; s < 100; ++s) same += (*a)->train_sample_offset(s) == (*c)->train_sample_offset(s);
  EXPECT_LT(same, 20);
}

}  // namespace
}  // namespace strata::train
