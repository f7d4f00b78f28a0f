// The one way Strata parses a JSON file a user hands it (DeepSpeed config,
// config.json, safetensors headers and indexes, checkpoint manifests).
//
// nlohmann::json alone accepts what Strata must refuse: it keeps the last of
// two equal keys silently, and it builds any nesting depth (a 200 KB file of
// 100k nested arrays took gigabytes before failing). parse_json refuses both,
// before it allocates for them, and reports where a syntax error is (byte,
// line, column). Callers word the message for their file type from JsonError.
//
// Pure and thread-safe; no I/O.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace strata {

// Deeper than any file Strata reads needs (DeepSpeed configs nest 4 levels).
inline constexpr int kMaxJsonDepth = 64;

struct JsonParseOptions {
  int max_depth = kMaxJsonDepth;
  bool allow_comments = false;  // "//" and "/* */" (DeepSpeed's loader allows them)
};

struct JsonError {
  enum Kind { kNone, kSyntax, kDuplicateKey, kTooDeep } kind = kNone;
  uint64_t byte = 0;           // kSyntax: characters read up to the offending one (1-based)
  uint64_t line = 1, column = 1;
  std::string what;            // kSyntax: nlohmann's reason, without its prefix
  std::string path;            // kDuplicateKey / kTooDeep: "a.b[2].c" (each part clipped)
  std::string key;             // kDuplicateKey: the key (clipped)
  // "malformed JSON at byte 57 (line 4, column 12): <what>",
  // "a.b: duplicate key (only one value may be given)",
  // "a.b: nested deeper than 64 levels".
  std::string message() const;
};

// Parses `text`. On failure returns false and fills *err (the value of *out
// is unspecified). Never throws.
bool parse_json(std::string_view text, nlohmann::json* out, JsonError* err, const JsonParseOptions& options = {});

// A user-supplied string quoted in a message, clipped to `max` characters
// ("abc…(5242880 bytes)") so a 5 MB key is not echoed whole.
std::string clip_for_message(std::string_view s, size_t max = 80);
// The first `max` of `names`, each clipped, ", "-separated, then
// " and N more" ("a, b and 3 more").
std::string names_for_message(const std::vector<std::string>& names, size_t max = 4);

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code
// points past U+10FFFF): what a name must be to go into a JSON file Strata
// writes (checkpoint manifests, traces).
bool is_valid_utf8(std::string_view s);

}  // namespace strata
