#include "common/json.h"

#include <fmt/format.h>

#include <set>
#include <vector>

namespace strata {

using json = nlohmann::json;

std::string clip_for_message(std::string_view s, size_t max) {
  if (s.size() <= max) return std::string(s);
  return fmt::format("{}...({} bytes)", s.substr(0, max), s.size());
}

std::string names_for_message(const std::vector<std::string>& names, size_t max) {
  std::string list;
  for (size_t i = 0; i < names.size() && i < max; ++i) list += (i ? ", " : "") + clip_for_message(names[i], 60);
  if (names.size() > max) list += fmt::format(" and {} more", names.size() - max);
  return list;
}

bool is_valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;  // the second byte's range (tighter after E0, ED, F0, F4)
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // past U+10FFFF
    } else {
      return false;
    }
    if (n - i < len || p[i + 1] < lo || p[i + 1] > hi) return false;
    for (size_t k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return false;
    i += len;
  }
  return true;
}

std::string JsonError::message() const {
  switch (kind) {
    case kNone:
      return "no error";
    case kSyntax:
      return fmt::format("malformed JSON at byte {} (line {}, column {}): {}", byte, line, column, what);
    case kDuplicateKey:
      return fmt::format("{}: duplicate key (only one value may be given)", path);
    case kTooDeep:
      return fmt::format("{}: nested deeper than {} levels", path.empty() ? "(top)" : path, kMaxJsonDepth);
  }
  return "?";
}

namespace {

std::string join_path(const std::string& parent, std::string_view key) {
  std::string k = clip_for_message(key, 60);
  return parent.empty() ? k : parent + "." + k;
}

// Walks the parse events: refuses a duplicate key in any object and nesting
// beyond the limit. Paths are built only for the open containers (at most
// max_depth of them, each part clipped), so memory stays linear in the input.
struct Guard {
  struct Frame {
    bool is_array = false;
    std::string path;
    std::set<std::string> keys;
    std::string pending_key;
    size_t index = 0;
  };
  int max_depth;
  std::vector<Frame> stack;
  int skipped = 0;  // containers opened past the limit (not tracked)
  JsonError* err;

  std::string child_path() {
    if (stack.empty()) return "";
    Frame& top = stack.back();
    if (top.is_array) return fmt::format("{}[{}]", top.path, top.index++);
    return join_path(top.path, top.pending_key);
  }

  bool operator()(int /*depth*/, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start: {
        if (skipped > 0 || static_cast<int>(stack.size()) >= max_depth) {
          if (skipped++ == 0 && err->kind == JsonError::kNone) {
            err->kind = JsonError::kTooDeep;
            err->path = child_path();
          }
          return false;
        }
        Frame f;
        f.is_array = ev == json::parse_event_t::array_start;
        f.path = child_path();
        stack.push_back(std::move(f));
        return true;
      }
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (skipped > 0) {
          --skipped;
          return false;
        }
        if (!stack.empty()) stack.pop_back();
        return true;
      case json::parse_event_t::key:
        if (skipped > 0) return false;
        if (!stack.empty()) {
          Frame& top = stack.back();
          top.pending_key = parsed.get<std::string>();
          if (!top.keys.insert(top.pending_key).second && err->kind == JsonError::kNone) {
            err->kind = JsonError::kDuplicateKey;
            err->path = join_path(top.path, top.pending_key);
            err->key = clip_for_message(top.pending_key);
          }
        }
        return true;
      case json::parse_event_t::value:
        if (skipped > 0) return false;
        if (!stack.empty() && stack.back().is_array) stack.back().index++;
        return true;
    }
    return true;
  }
};

// Where the number literal `num` stands in `text` as a whole token, outside
// strings (npos if nowhere).
size_t find_number(std::string_view text, std::string_view num) {
  auto number_char = [](char c) { return (c >= '0' && c <= '9') || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-'; };
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
      continue;
    }
    if (text.compare(i, num.size(), num) == 0 && (i == 0 || !number_char(text[i - 1])) &&
        (i + num.size() == text.size() || !number_char(text[i + num.size()])))
      return i;
  }
  return std::string_view::npos;
}

// err->byte = `byte` (1-based; 0: unknown), and its line and column in `text`.
void locate(std::string_view text, uint64_t byte, JsonError* err) {
  const size_t at = byte == 0 ? 0 : std::min<size_t>(byte - 1, text.size());
  err->byte = byte;
  err->line = err->column = 1;
  for (size_t i = 0; i < at; ++i) {
    if (text[i] == '\n') {
      ++err->line;
      err->column = 1;
    } else {
      ++err->column;
    }
  }
}

}  // namespace

bool parse_json(std::string_view text, json* out, JsonError* err, const JsonParseOptions& options) {
  *err = JsonError{};
  Guard guard{options.max_depth, {}, 0, err};
  try {
    *out = json::parse(text.begin(), text.end(), std::ref(guard), /*allow_exceptions=*/true,
                       /*ignore_comments=*/options.allow_comments);
  } catch (const json::parse_error& e) {
    if (err->kind != JsonError::kNone) return false;  // found first; the syntax error came after
    // nlohmann's text starts "[json.exception.parse_error.101] parse error at
    // line 1, column 5: "; keep what follows and say where ourselves.
    std::string what = e.what();
    if (auto p = what.find("parse error"); p != std::string::npos) {
      if (auto colon = what.find(": ", p); colon != std::string::npos) what = what.substr(colon + 2);
    }
    err->kind = JsonError::kSyntax;
    err->what = clip_for_message(what, 200);
    // e.byte counts characters read, so the offending one is at index byte-1.
    locate(text, e.byte, err);
    return false;
  } catch (const std::exception& e) {
    if (err->kind != JsonError::kNone) return false;
    // A number past double's range: "[json.exception.out_of_range.406] number
    // overflow parsing '1e999'" gives no position; find the literal.
    std::string what = e.what();
    if (auto p = what.find("] "); p != std::string::npos) what = what.substr(p + 2);
    err->kind = JsonError::kSyntax;
    err->what = clip_for_message(what, 200);
    const size_t q = what.find('\''), q2 = what.rfind('\'');
    const size_t at =
        q != std::string::npos && q2 > q + 1 ? find_number(text, what.substr(q + 1, q2 - q - 1)) : std::string_view::npos;
    locate(text, at == std::string_view::npos ? 0 : at + 1, err);
    return false;
  }
  return err->kind == JsonError::kNone;
}

}  // namespace strata
