// `strata init-model`: a randomly initialised Llama model in the Hugging Face
// layout (config.json + model.safetensors, or shards with an index), the way
// transformers initialises one: normal(0, --init-std) for linear and embedding
// weights, ones for the RMSNorm weights. Deterministic by --seed on every
// machine (src/model/llama_init.h).
#include <dirent.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

#include "commands.h"
#include "finetune.h"
#include "common/dtype_parse.h"
#include "common/units.h"
#include "model/llama_init.h"

namespace strata::tools {
namespace {

struct InitModelOptions {
  uint32_t layers = 4;
  uint64_t dim = 256;
  uint32_t heads = 8;
  uint32_t kv_heads = 4;
  uint64_t ffn_dim = 688;
  uint64_t vocab = 256;
  uint64_t max_seq = 1024;
  std::string dtype = "bf16";
  uint64_t seed = 0;
  bool tie_embeddings = false;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  double init_std = 0.02;
  std::string max_shard_size = "0";
  bool force = false;
  std::string out = "strata-model";
};

int fail(const std::string& msg) {
  std::fprintf(stderr, "strata init-model: %s\n", msg.c_str());
  return 1;
}

// 1: empty or missing, 0: has entries, -1: not a directory / unreadable.
int dir_state(const std::string& path, std::string* why) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return 1;
  if (!S_ISDIR(st.st_mode)) {
    *why = path + " exists and is not a directory";
    return -1;
  }
  std::error_code ec;
  auto it = std::filesystem::directory_iterator(path, ec);
  if (ec) {
    *why = fmt::format("cannot list {}: {}", path, ec.message());
    return -1;
  }
  return it == std::filesystem::directory_iterator() ? 1 : 0;
}

int run(const InitModelOptions& o) {
  auto dt = parse_dtype(o.dtype);
  if (!dt.ok()) return fail("--dtype: " + dt.status().message());
  auto shard = parse_bytes(o.max_shard_size);
  if (!shard.ok()) return fail("--max-shard-size: " + shard.status().message());
  if (o.out.empty()) return fail("--out must name a directory");

  model::LlamaConfig c;
  c.hidden_size = o.dim;
  c.intermediate_size = o.ffn_dim;
  c.num_hidden_layers = o.layers;
  c.num_attention_heads = o.heads;
  c.num_key_value_heads = o.kv_heads;
  c.vocab_size = o.vocab;
  c.max_position_embeddings = o.max_seq;
  c.tie_word_embeddings = o.tie_embeddings;
  c.rope.theta = o.rope_theta;
  c.rms_norm_eps = o.norm_eps;
  c.initializer_range = o.init_std;
  c.torch_dtype = *dt;
  if (Status st = model::validate_llama_config(c); !st.ok()) {
    // Speak in flags, not config keys.
    std::string m = st.message();
    for (auto [key, flag] : {std::pair{"hidden_size", "--dim"},
                             {"intermediate_size", "--ffn-dim"},
                             {"num_hidden_layers", "--layers"},
                             {"num_attention_heads", "--heads"},
                             {"num_key_value_heads", "--kv-heads"},
                             {"vocab_size", "--vocab"},
                             {"max_position_embeddings", "--max-seq"},
                             {"rms_norm_eps", "--norm-eps"},
                             {"rope_theta", "--rope-theta"},
                             {"initializer_range", "--init-std"}}) {
      const std::string quoted = std::string("\"") + key + "\"";
      for (size_t p; (p = m.find(quoted)) != std::string::npos;) m.replace(p, quoted.size(), flag);
      for (size_t p; (p = m.find(key)) != std::string::npos;) m.replace(p, std::strlen(key), flag);
    }
    return fail(m);
  }
  auto spec = llama_model_spec(c.shape());
  if (!spec.ok()) return fail(spec.status().message());

  std::string why;
  int state = dir_state(o.out, &why);
  if (state < 0) return fail(why);
  if (state == 0 && !o.force)
    return fail(fmt::format("{} is not empty; use --force to write the model there anyway", o.out));
  std::error_code ec;
  const bool made = !std::filesystem::exists(o.out, ec);
  std::filesystem::create_directories(o.out, ec);
  if (ec) return fail(fmt::format("cannot create {}: {}", o.out, ec.message()));
  // What this run made goes again when it fails (the writer removes its files).
  auto undo = [&] {
    if (made) (void)::rmdir(o.out.c_str());
  };

  const uint64_t params = spec->numel();
  // The weights must fit: a model too large for the disk would fill it first.
  const uint64_t bytes = params * dtype_size(*dt);
  struct statvfs fs {};
  if (::statvfs(o.out.c_str(), &fs) == 0 && uint64_t{fs.f_bavail} * fs.f_frsize < bytes + (uint64_t{1} << 20)) {
    undo();
    return fail(fmt::format("the weights take {} ({} parameters as {}), and {} has {} free", format_bytes(bytes),
                            params, dtype_name(*dt), o.out, format_bytes(uint64_t{fs.f_bavail} * fs.f_frsize)));
  }
  const auto t0 = std::chrono::steady_clock::now();
  Status st;
  {
    StopSignals signals("\nstopping: removing the partly written model; signal again to abort now\n");
    st = model::write_random_llama(o.out, c, model::from_dtype(*dt), o.seed, *shard, signals.flag());
  }
  if (!st.ok()) {
    undo();
    (void)fail(st.message());
    return st.code() == StatusCode::kCancelled ? kExitInterrupted : 1;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("wrote %s: Llama, %u layers, dim %llu, %u heads (%u kv), ffn %llu, vocab %llu%s\n", o.out.c_str(),
              c.num_hidden_layers, static_cast<unsigned long long>(c.hidden_size), c.num_attention_heads,
              c.num_key_value_heads, static_cast<unsigned long long>(c.intermediate_size),
              static_cast<unsigned long long>(c.vocab_size), c.tie_word_embeddings ? ", tied embeddings" : "");
  std::printf("  %llu parameters, %s as %s, seed %llu, %.2f s\n", static_cast<unsigned long long>(params),
              format_bytes(params * dtype_size(*dt)).c_str(), dtype_name(*dt), static_cast<unsigned long long>(o.seed),
              secs);
  return 0;
}

}  // namespace

void register_init_model(CLI::App& app) {
  auto o = std::make_shared<InitModelOptions>();
  CLI::App* cmd = app.add_subcommand(
      "init-model", "Write a randomly initialised Llama model (config.json + safetensors, Hugging Face layout)");
  cmd->add_option("--layers", o->layers, "Decoder layers")->capture_default_str();
  cmd->add_option("--dim", o->dim, "Hidden size")->capture_default_str();
  cmd->add_option("--heads", o->heads, "Attention heads (must divide --dim)")->capture_default_str();
  cmd->add_option("--kv-heads", o->kv_heads, "Key/value heads (must divide --heads)")->capture_default_str();
  cmd->add_option("--ffn-dim", o->ffn_dim, "MLP intermediate size")->capture_default_str();
  cmd->add_option("--vocab", o->vocab, "Vocabulary size (256: byte-level tokens)")->capture_default_str();
  cmd->add_option("--max-seq", o->max_seq, "max_position_embeddings")->capture_default_str();
  cmd->add_option("--dtype", o->dtype, "Weight dtype: bf16|fp16|fp32")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Random seed (same weights on every machine)")->capture_default_str();
  cmd->add_flag("--tie-embeddings", o->tie_embeddings, "Share embed_tokens with the output head (no lm_head)");
  cmd->add_option("--rope-theta", o->rope_theta, "Rotary embedding base")->capture_default_str();
  cmd->add_option("--norm-eps", o->norm_eps, "RMSNorm epsilon")->capture_default_str();
  cmd->add_option("--init-std", o->init_std, "Std of the normal init (initializer_range)")->capture_default_str();
  cmd->add_option("--max-shard-size", o->max_shard_size, "Largest shard (e.g. 2GB); 0 = one model.safetensors file")
      ->capture_default_str();
  cmd->add_flag("--force", o->force, "Write into a non-empty --out directory");
  cmd->add_option("--out", o->out, "Output directory (created; must be empty unless --force)")->capture_default_str();
  for (CLI::Option* opt : cmd->get_options()) opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd->callback([o] { set_exit_code(run(*o)); });
}

}  // namespace strata::tools
