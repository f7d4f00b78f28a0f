#include "train/demo_data.h"

#include <cerrno>
#include <cstdio>

#include "train/data.h"

namespace strata::train {
namespace {

constexpr const char* kAdj[] = {"small", "red", "old", "quick", "quiet", "green"};
constexpr const char* kNoun[] = {"cat", "dog", "bird", "fox", "horse", "mouse", "fish", "owl"};
constexpr const char* kVerb[] = {"sees", "likes", "chases", "finds", "helps", "follows"};
constexpr const char* kVerb2[] = {"run", "swim", "fly", "jump", "sing", "climb"};

template <size_t N>
const char* pick(const char* const (&words)[N], uint64_t r) {
  return words[r % N];
}

}  // namespace

std::string demo_text(uint64_t bytes, uint64_t seed) {
  std::string out;
  out.reserve(bytes + 64);
  for (uint64_t line = 0; out.size() < bytes; ++line) {
    auto r = [&](uint64_t k) { return counter_random(seed, line, k); };
    switch (r(0) % 5) {
      case 0:
      case 1:
      case 2:
        out += "the ";
        out += pick(kAdj, r(1));
        out += ' ';
        out += pick(kNoun, r(2));
        out += ' ';
        out += pick(kVerb, r(3));
        out += " the ";
        out += pick(kAdj, r(4));
        out += ' ';
        out += pick(kNoun, r(5));
        out += " .\n";
        break;
      case 3: {
        const uint64_t a = r(1) % 10, b = r(2) % 10;
        out += std::to_string(a) + " plus " + std::to_string(b) + " is " + std::to_string(a + b) + " .\n";
        break;
      }
      default: {
        const uint64_t v1 = r(2) % 6, v2 = (v1 + 1 + r(3) % 5) % 6;  // two different verbs
        out += "a ";
        out += pick(kNoun, r(1));
        out += " can ";
        out += kVerb2[v1];
        out += " but not ";
        out += kVerb2[v2];
        out += " .\n";
        break;
      }
    }
  }
  return out;
}

Status write_demo_text(const std::string& path, uint64_t bytes, uint64_t seed) {
  const std::string text = demo_text(bytes, seed);
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return Status::from_errno(errno, "demo data " + path + ": cannot create");
  const size_t n = std::fwrite(text.data(), 1, text.size(), f);
  const int werr = errno;
  if (std::fclose(f) != 0 || n != text.size())
    return Status::from_errno(n != text.size() ? werr : errno, "demo data " + path + ": write failed");
  return {};
}

}  // namespace strata::train
