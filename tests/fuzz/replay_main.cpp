// Runs a libFuzzer target over files, without libFuzzer: each argument is a
// file or a directory of files, and each file is one input. Built with any
// compiler, so every corpus entry (the seeds and every crash once found) is
// replayed by ctest in every build, the sanitizer builds included.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

int run_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "replay: cannot read %s\n", p.c_str());
    return 1;
  }
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // A copy of exactly `size` bytes, so ASan sees a read past the end.
  std::vector<uint8_t> exact(bytes.begin(), bytes.end());
  LLVMFuzzerTestOneInput(exact.empty() ? nullptr : exact.data(), exact.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int files = 0, errors = 0;
  for (int i = 1; i < argc; ++i) {
    std::filesystem::path arg(argv[i]);
    std::error_code ec;
    if (std::filesystem::is_directory(arg, ec)) {
      std::vector<std::filesystem::path> entries;
      for (const auto& e : std::filesystem::directory_iterator(arg)) {
        if (e.is_regular_file()) entries.push_back(e.path());
      }
      std::sort(entries.begin(), entries.end());
      for (const auto& e : entries) errors += run_file(e), ++files;
    } else {
      errors += run_file(arg), ++files;
    }
  }
  if (files == 0) {
    std::fprintf(stderr, "replay: no input files given\n");
    return 1;
  }
  std::printf("replay: %d inputs, %d unreadable\n", files, errors);
  return errors ? 1 : 0;
}
