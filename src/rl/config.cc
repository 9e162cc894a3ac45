#include "rl/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string_view>
#include <system_error>
#include <utility>

#include "common/fs.h"
#include "common/str_cat.h"

namespace bragg::rl {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kTables[] = {"run",        "model", "tokenizer", "task",  "sampling",
                                        "warm_start", "train", "fleet",     "export"};

// The problems found in one file. Each is one line, "<file>: <key>: <what>", with " (line N)"
// when the key is in the file; they are reported all at once, in file order, so that one run
// shows everything to fix.
class Problems {
 public:
  explicit Problems(std::string name) : name_(std::move(name)) {}

  // Where `key` (a full path, "train.lr") is set in the file: later problems with it say so.
  void Locate(const std::string& key, uint32_t line) { lines_[key] = line; }
  void Add(const std::string& key, std::string_view what) {
    auto it = lines_.find(key);
    uint32_t line = it == lines_.end() ? 0 : it->second;
    AddAt(key, what, line);
  }
  void AddAt(const std::string& key, std::string_view what, uint32_t line) {
    std::string text = Cat(name_, ": ", key, ": ", what);
    if (line > 0) {
      text += Cat(" (line ", line, ")");
    }
    problems_.push_back({line == 0 ? std::numeric_limits<uint32_t>::max() : line, text});
  }
  bool empty() const { return problems_.empty(); }

  Status ToStatus() {
    std::stable_sort(problems_.begin(), problems_.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    std::string message;
    for (const auto& [line, text] : problems_) {
      if (!message.empty()) {
        message += '\n';
      }
      message += text;
    }
    return absl::InvalidArgumentError(message);
  }

 private:
  std::string name_;
  std::map<std::string, uint32_t> lines_;
  std::vector<std::pair<uint32_t, std::string>> problems_;
};

// `s` in double quotes, as TOML's basic strings escape it (toml++ prints 'x').
// Long strings are cut to their first 40 bytes (on a UTF-8 character boundary) and "...".
std::string Quote(std::string_view s) {
  bool cut = s.size() > 48;
  if (cut) {
    size_t end = 40;
    while (end > 0 && (static_cast<unsigned char>(s[end]) & 0xC0) == 0x80) {
      --end;
    }
    s = s.substr(0, end);
  }
  std::string out = "\"";
  for (char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) {
          out += fmt::format("\\u{:04X}", static_cast<unsigned char>(ch));
        } else {
          out += ch;
        }
    }
  }
  return out + (cut ? "...\"" : "\"");
}

// "string \"x\"", "float 1.5", "a table": what a value is, for "expected ..., got ...".
std::string Describe(const toml::node& node) {
  std::ostringstream text;
  std::string_view kind;
  switch (node.type()) {
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      return "an array";
    case toml::node_type::string:
      kind = "string";
      text << Quote(node.as_string()->get());
      break;
    case toml::node_type::integer:
      kind = "integer";
      text << *node.as_integer();
      break;
    case toml::node_type::floating_point:
      kind = "float";
      text << *node.as_floating_point();
      break;
    case toml::node_type::boolean:
      kind = "boolean";
      text << *node.as_boolean();
      break;
    case toml::node_type::date:
      kind = "date";
      text << *node.as_date();
      break;
    case toml::node_type::time:
      kind = "time";
      text << *node.as_time();
      break;
    case toml::node_type::date_time:
      kind = "date-time";
      text << *node.as_date_time();
      break;
    default:
      return "nothing";
  }
  return Cat(kind, " ", text.str());
}

// Optimal string alignment distance (Levenshtein with adjacent transpositions): "trian" is one
// edit from "train".
size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) {
    d[i][0] = i;
  }
  for (size_t j = 0; j <= b.size(); ++j) {
    d[0][j] = j;
  }
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// The closest of `candidates` within two edits (and fewer edits than it has characters, so that
// "ab" does not suggest "lr"); "" if none.
std::string Closest(std::string_view key, const std::vector<std::string>& candidates) {
  // No known key is this long; a hostile one would cost its length times each candidate's.
  if (key.size() > 64) {
    return "";
  }
  std::string best;
  size_t best_distance = 3;
  for (const std::string& candidate : candidates) {
    size_t distance = EditDistance(key, candidate);
    if (distance < best_distance && distance < candidate.size()) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

// The allowed values of a number, for the check and its message.
struct Bounds {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false;
  bool hi_open = false;

  bool Contains(double x) const {
    return (lo_open ? x > lo : x >= lo) && (hi_open ? x < hi : x <= hi);
  }
  std::string Text() const {
    if (std::isinf(hi)) {
      return Cat(lo_open ? "> " : ">= ", lo);
    }
    return Cat("in ", lo_open ? "(" : "[", lo, ", ", hi, hi_open ? ")" : "]");
  }
};
Bounds AtLeast(double lo) { return {lo}; }
Bounds Above(double lo) { return {lo, std::numeric_limits<double>::infinity(), true}; }

// One table of the file ([train], [model.init]) read field by field into the struct. Each read
// records its key as known, so the reading code is the schema: a key in the file that no read
// asked for is unknown (CheckUnknown). An absent table reads as empty: every field keeps its
// default.
class Section {
 public:
  Section(Problems* problems, std::string path, const toml::table* table)
      : problems_(problems), path_(std::move(path)), table_(table) {}

  const std::string& path() const { return path_; }
  const toml::table* table() const { return table_; }
  // The keys read, sub-tables included, in reading order.
  const std::vector<std::string>& known() const { return known_; }
  // The value keys read (not sub-tables): ConfigKeys().
  const std::vector<std::string>& fields() const { return fields_; }
  bool Has(std::string_view key) const { return table_ && table_->contains(key); }
  std::string KeyPath(std::string_view key) const { return Cat(path_, ".", key); }

  template <typename T>
  void Int(std::string_view key, T* out, int64_t min) {
    const toml::node* node = Field(key);
    if (!node) {
      return;
    }
    const auto* value = node->as_integer();
    if (!value) {
      Wrong(key, *node, "an integer");
      return;
    }
    constexpr int64_t kMax =
        std::numeric_limits<T>::max() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
            ? std::numeric_limits<int64_t>::max()
            : static_cast<int64_t>(std::numeric_limits<T>::max());
    int64_t x = value->get();
    if (x < min) {
      problems_->Add(KeyPath(key), Cat("must be >= ", min, ", got ", x));
    } else if (x > kMax) {
      problems_->Add(KeyPath(key),
                     Cat("must be <= ", kMax, " (a ", sizeof(T) * 8, "-bit integer), got ", x));
    } else {
      *out = static_cast<T>(x);
    }
  }

  // An integer is taken for a number too (`lr = 1`); NaN and the infinities are not.
  void Number(std::string_view key, double* out, Bounds bounds) {
    const toml::node* node = Field(key);
    if (!node) {
      return;
    }
    double x;
    if (const auto* f = node->as_floating_point()) {
      x = f->get();
    } else if (const auto* i = node->as_integer()) {
      x = static_cast<double>(i->get());
    } else {
      Wrong(key, *node, "a number");
      return;
    }
    if (!std::isfinite(x)) {
      problems_->Add(KeyPath(key), Cat("must be a finite number, got ", Describe(*node)));
    } else if (!bounds.Contains(x)) {
      problems_->Add(KeyPath(key), Cat("must be ", bounds.Text(), ", got ", x));
    } else {
      *out = x;
    }
  }
  void Number(std::string_view key, float* out, Bounds bounds) {
    double x = *out;
    Number(key, &x, bounds);
    if (std::fabs(x) > std::numeric_limits<float>::max()) {
      problems_->Add(KeyPath(key), Cat("out of range for a 32-bit float, got ", x));
      return;
    }
    *out = static_cast<float>(x);
  }

  void Bool(std::string_view key, bool* out) {
    const toml::node* node = Field(key);
    if (!node) {
      return;
    }
    if (const auto* value = node->as_boolean()) {
      *out = value->get();
    } else {
      Wrong(key, *node, "a boolean (true or false)");
    }
  }

  void String(std::string_view key, std::string* out) {
    const toml::node* node = Field(key);
    if (!node) {
      return;
    }
    const auto* value = node->as_string();
    if (!value) {
      Wrong(key, *node, "a string");
      return;
    }
    // Strings here become paths, argv and URLs, where a NUL would silently cut them short.
    if (value->get().find('\0') != std::string::npos) {
      problems_->Add(KeyPath(key), "must not contain a NUL character");
      return;
    }
    *out = value->get();
  }

  // An array of non-empty strings (argv, stop strings, URLs); the array itself may be empty.
  void Strings(std::string_view key, std::vector<std::string>* out) {
    const toml::node* node = Field(key);
    if (!node) {
      return;
    }
    const auto* array = node->as_array();
    if (!array) {
      Wrong(key, *node, "an array of strings");
      return;
    }
    std::vector<std::string> values;
    bool ok = true;
    for (size_t i = 0; i < array->size(); ++i) {
      const toml::node& element = *array->get(i);
      std::string element_path = Cat(KeyPath(key), "[", i, "]");
      const auto* value = element.as_string();
      if (!value) {
        problems_->AddAt(element_path, Cat("expected a string, got ", Describe(element)),
                         element.source().begin.line);
        ok = false;
      } else if (value->get().empty()) {
        problems_->AddAt(element_path, "must not be empty", element.source().begin.line);
        ok = false;
      } else if (value->get().find('\0') != std::string::npos) {
        problems_->AddAt(element_path, "must not contain a NUL character",
                         element.source().begin.line);
        ok = false;
      } else {
        values.push_back(value->get());
      }
    }
    if (ok) {
      *out = std::move(values);
    }
  }

  // A sub-table ([model.init]): null when absent or not a table (a problem then).
  const toml::table* Table(std::string_view key) {
    known_.emplace_back(key);
    const toml::node* node = Find(key);
    if (!node) {
      return nullptr;
    }
    if (!node->is_table()) {
      Wrong(key, *node, Cat("a table ([", KeyPath(key), "])"));
      return nullptr;
    }
    return node->as_table();
  }

 private:
  const toml::node* Field(std::string_view key) {
    known_.emplace_back(key);
    fields_.emplace_back(key);
    return Find(key);
  }
  const toml::node* Find(std::string_view key) {
    const toml::node* node = table_ ? table_->get(key) : nullptr;
    if (node) {
      problems_->Locate(KeyPath(key), node->source().begin.line);
    }
    return node;
  }
  void Wrong(std::string_view key, const toml::node& node, std::string_view expected) {
    problems_->Add(KeyPath(key), Cat("expected ", expected, ", got ", Describe(node)));
  }

  Problems* problems_;
  std::string path_;
  const toml::table* table_;
  std::vector<std::string> known_;
  std::vector<std::string> fields_;
};

// Reads every table of `root` into `config` (types and each key's own range). The sections
// read are appended to `sections`, in order.
void ReadTables(const toml::table& root, Config* config, Problems* problems,
                std::vector<std::unique_ptr<Section>>* sections) {
  auto open = [&](std::string_view name, const toml::table* parent) -> Section& {
    const toml::table* table = nullptr;
    if (const toml::node* node = parent ? parent->get(name) : nullptr) {
      problems->Locate(std::string(name), node->source().begin.line);
      if (node->is_table()) {
        table = node->as_table();
      } else {
        problems->Add(std::string(name),
                      Cat("expected a table ([", name, "]), got ", Describe(*node)));
      }
    }
    sections->push_back(std::make_unique<Section>(problems, std::string(name), table));
    return *sections->back();
  };

  RunConfig& run = config->run;
  Section& r = open("run", &root);
  r.String("dir", &run.dir);
  r.Int("seed", &run.seed, 0);
  r.Int("steps", &run.steps, 1);
  r.Int("max_staleness", &run.max_staleness, 0);
  r.Number("time_limit_s", &run.time_limit_s, AtLeast(0));
  r.Number("target_reward", &run.target_reward, Bounds{0, 1});
  r.Int("target_window", &run.target_window, 1);
  r.Int("checkpoint_every", &run.checkpoint_every, 1);
  r.String("metrics_listen", &run.metrics_listen);

  ModelConfig& model = config->model;
  Section& m = open("model", &root);
  m.String("path", &model.path);
  const toml::table* init_table = m.Table("init");
  ModelInit init;
  Section& mi =
      *sections->emplace_back(std::make_unique<Section>(problems, "model.init", init_table));
  mi.Bool("moe", &init.moe);
  mi.Int("hidden", &init.hidden, 1);
  mi.Int("intermediate", &init.intermediate, 1);
  mi.Int("layers", &init.layers, 1);
  mi.Int("heads", &init.heads, 1);
  mi.Int("kv_heads", &init.kv_heads, 1);
  mi.Int("head_dim", &init.head_dim, 2);
  mi.Int("experts", &init.experts, 1);
  mi.Int("top_k", &init.top_k, 1);
  mi.Int("moe_intermediate", &init.moe_intermediate, 1);
  mi.Int("context", &init.context, 1);
  mi.Number("std", &init.std, Above(0));
  mi.Int("seed", &init.seed, 0);
  if (init_table) {
    model.init = init;
  }

  Section& tk = open("tokenizer", &root);
  tk.String("vocab", &config->tokenizer.vocab);

  TaskConfig& task = config->task;
  Section& t = open("task", &root);
  t.String("prompts", &task.prompts);
  t.String("eval_prompts", &task.eval_prompts);
  t.String("files", &task.files);
  t.String("image", &task.image);
  t.Strings("tool_server", &task.tool_server);
  t.Strings("verifier", &task.verifier);
  t.Bool("verifier_in_tool_server", &task.verifier_in_tool_server);
  t.Strings("setup", &task.setup);
  t.Int("max_turns", &task.max_turns, 1);
  t.Int("max_new_tokens", &task.max_new_tokens, 1);
  t.Int("max_tokens", &task.max_tokens, 2);
  t.Strings("stop", &task.stop);
  t.Number("tool_timeout_s", &task.tool_timeout_s, Above(0));
  t.Int("sandbox_memory_mb", &task.sandbox_memory_mb, 16);
  t.Int("sandbox_pids", &task.sandbox_pids, 1);
  t.String("balance_by", &task.balance_by);
  t.Number("focus", &task.focus, Bounds{0, 1});
  t.Int("eval_every", &task.eval_every, 0);

  SamplingConfig& sampling = config->sampling;
  Section& s = open("sampling", &root);
  s.Number("temperature", &sampling.temperature, AtLeast(0));
  s.Number("top_p", &sampling.top_p, Bounds{0, 1, true, false});
  s.Int("group_size", &sampling.group_size, 2);

  WarmStartConfig& warm = config->warm_start;
  Section& w = open("warm_start", &root);
  w.String("traces", &warm.traces);
  w.Int("steps", &warm.steps, 0);
  w.Int("batch", &warm.batch, 1);
  w.Number("lr", &warm.lr, Above(0));

  TrainConfig& train = config->train;
  Section& tr = open("train", &root);
  tr.Number("lr", &train.lr, Above(0));
  tr.Int("groups_per_step", &train.groups_per_step, 1);
  tr.Int("minibatches", &train.minibatches, 1);
  tr.Number("clip_low", &train.clip_low, Bounds{0, 1, false, true});
  tr.Number("clip_high", &train.clip_high, Bounds{0, 1, false, true});
  tr.Number("tis_cap", &train.tis_cap, AtLeast(0));
  tr.Number("kl_coef", &train.kl_coef, AtLeast(0));
  tr.Number("entropy_coef", &train.entropy_coef, AtLeast(0));
  tr.Number("max_grad_norm", &train.max_grad_norm, AtLeast(0));
  tr.Number("adam_eps", &train.adam_eps, Above(0));
  tr.Number("weight_decay", &train.weight_decay, AtLeast(0));
  tr.Bool("normalize_std", &train.normalize_std);
  tr.Int("threads", &train.threads, 1);
  tr.Int("max_tokens", &train.max_tokens, 1);
  tr.Bool("deterministic", &train.deterministic);
  tr.Bool("external", &train.external);
  tr.String("external_weights", &train.external_weights);
  tr.Number("external_timeout_s", &train.external_timeout_s, Above(0));

  FleetConfig& fleet = config->fleet;
  Section& f = open("fleet", &root);
  f.Int("engines", &fleet.engines, 0);
  f.Strings("engine_urls", &fleet.engine_urls);
  f.String("gateway", &fleet.gateway);
  f.Int("engine_threads", &fleet.engine_threads, 1);
  f.Int("kv_cache_tokens", &fleet.kv_cache_tokens, 1);
  f.String("pbox", &fleet.pbox);
  f.Int("concurrency", &fleet.concurrency, 1);
  f.String("bin_dir", &fleet.bin_dir);
  // Existing servers replace the local engines unless engines is given (and then refused).
  if (!f.Has("engines") && !fleet.engine_urls.empty()) {
    fleet.engines = 0;
  }

  ExportConfig& ex = config->export_;
  Section& x = open("export", &root);
  x.Bool("batches", &ex.batches);
  x.Int("dp", &ex.dp, 1);
  x.Int("cp", &ex.cp, 1);
  x.Int("tp", &ex.tp, 1);
  x.Bool("sequence_parallel", &ex.sequence_parallel);
  x.Int("max_tokens", &ex.max_tokens, 0);
  if (train.external) {
    if (x.Has("batches") && !ex.batches) {
      problems->Add("export.batches",
                    "must be true with train.external: the external trainer "
                    "trains on the exported batches");
    }
    ex.batches = true;
  }
}

// Keys and tables no Section read: typos, keys in the wrong table, keys outside any table.
void CheckUnknown(const toml::table& root, const std::vector<std::unique_ptr<Section>>& sections,
                  Problems* problems) {
  auto where_else = [&](std::string_view key, const Section* except) {
    std::vector<std::string> found;
    for (const auto& section : sections) {
      if (section.get() != except && std::find(section->fields().begin(), section->fields().end(),
                                               key) != section->fields().end()) {
        found.push_back(section->KeyPath(key));
      }
    }
    std::string text;
    for (size_t i = 0; i < found.size(); ++i) {
      text += Cat(i == 0 ? "" : i + 1 == found.size() ? " or " : ", ", found[i]);
    }
    return text;
  };

  std::vector<std::string> tables(std::begin(kTables), std::end(kTables));
  tables.push_back("model.init");
  std::string table_list;
  for (std::string_view table : kTables) {
    table_list += Cat(table_list.empty() ? "" : ", ", "[", table, "]");
  }
  for (const auto& [key, node] : root) {
    std::string_view name = key.str();
    if (std::find(std::begin(kTables), std::end(kTables), name) != std::end(kTables)) {
      continue;
    }
    uint32_t line = key.source().begin.line;
    if (node.is_table() || node.is_array_of_tables()) {
      std::string closest = Closest(name, tables);
      problems->AddAt(std::string(name),
                      closest.empty() ? Cat("unknown table; the tables are ", table_list)
                                      : Cat("unknown table; did you mean [", closest, "]?"),
                      line);
    } else if (std::string elsewhere = where_else(name, nullptr); !elsewhere.empty()) {
      problems->AddAt(std::string(name),
                      Cat("a key outside any table; did you mean ", elsewhere, "?"), line);
    } else {
      problems->AddAt(std::string(name),
                      Cat("unknown key outside any table; the tables are ", table_list), line);
    }
  }

  for (const auto& section : sections) {
    if (!section->table()) {
      continue;
    }
    for (const auto& [key, node] : *section->table()) {
      std::string_view name = key.str();
      const std::vector<std::string>& known = section->known();
      if (std::find(known.begin(), known.end(), name) != known.end()) {
        continue;
      }
      std::string what = node.is_table() ? "unknown table" : "unknown key";
      if (std::string closest = Closest(name, known); !closest.empty()) {
        what += Cat("; did you mean ", section->KeyPath(closest), "?");
      } else if (std::string elsewhere = where_else(name, section.get()); !elsewhere.empty()) {
        what += Cat("; did you mean ", elsewhere, "?");
      } else {
        std::string list;
        for (const std::string& k : section->fields()) {
          list += Cat(list.empty() ? "" : ", ", k);
        }
        what += Cat("; [", section->path(), "] has ", list);
      }
      problems->AddAt(section->KeyPath(name), what, key.source().begin.line);
    }
  }
}

// Relative to `base`, absolute and lexically normal, without a trailing '/'; "" stays "".
std::string Resolve(const fs::path& base, const std::string& path) {
  if (path.empty()) {
    return path;
  }
  fs::path resolved = (base / path).lexically_normal();
  if (!resolved.has_filename() && resolved.has_relative_path()) {
    resolved = resolved.parent_path();
  }
  return resolved.string();
}

enum class Expect { kFile, kDirectory, kModelDirectory };

void MustExist(const std::string& key, const std::string& path, Expect expect, Problems* problems) {
  std::error_code ec;
  fs::file_status status = fs::status(path, ec);
  if (status.type() == fs::file_type::not_found) {
    problems->Add(key, Cat(path, " does not exist"));
    return;
  }
  if (ec) {
    problems->Add(key, Cat("cannot access ", path, ": ", ec.message()));
    return;
  }
  bool is_directory = fs::is_directory(status);
  if (expect == Expect::kFile && is_directory) {
    problems->Add(key, Cat(path, " is a directory, expected a file"));
  } else if (expect != Expect::kFile && !is_directory) {
    problems->Add(key, Cat(path, " is not a directory"));
  } else if (expect == Expect::kModelDirectory && !fs::exists(fs::path(path) / "config.json", ec)) {
    problems->Add(key, Cat(path, " has no config.json (expected a Hugging Face model directory)"));
  }
}

bool IsUrl(const std::string& s) {
  return s.rfind("http://", 0) == 0 || s.rfind("https://", 0) == 0;
}

// What no single key can say: required keys, keys that go together, paths.
void CheckWhole(Config* c, const fs::path& base, Problems* problems) {
  if (c->run.dir.empty()) {
    problems->Add("run.dir", "must not be empty (the run's output directory)");
  }
  if (!c->run.metrics_listen.empty()) {
    auto hp = ParseHostPort(c->run.metrics_listen);
    if (!hp.ok()) {
      problems->Add("run.metrics_listen", Cat(hp.status().message(), " (\"\" for no /metrics)"));
    }
  }

  if (!c->model.path.empty() && c->model.init) {
    problems->Add("model", "both model.path and [model.init] are set; keep one");
  } else if (c->model.path.empty() && !c->model.init) {
    problems->Add("model",
                  "neither model.path (a Hugging Face directory) nor [model.init] (a random "
                  "model's shape) is set; give one");
  }
  if (const ModelInit* init = c->model.init ? &*c->model.init : nullptr) {
    if (init->heads % init->kv_heads != 0) {
      problems->Add("model.init.kv_heads",
                    Cat("must divide model.init.heads (", init->heads, "), got ", init->kv_heads));
    }
    if (init->head_dim % 2 != 0) {
      problems->Add("model.init.head_dim",
                    Cat("must be even (rotary embeddings rotate pairs), got ", init->head_dim));
    }
    if (init->moe && init->top_k > init->experts) {
      problems->Add("model.init.top_k",
                    Cat("must be <= model.init.experts (", init->experts, "), got ", init->top_k));
    }
    if (init->context < c->task.max_tokens) {
      problems->Add("model.init.context", Cat("must be >= task.max_tokens (", c->task.max_tokens,
                                              ": a whole trajectory), got ", init->context));
    }
  }

  if (c->tokenizer.vocab.empty()) {
    problems->Add("tokenizer.vocab", "missing; set it to the vocabulary (a JSON list of tokens)");
  }
  TaskConfig& task = c->task;
  if (task.prompts.empty()) {
    problems->Add("task.prompts",
                  "missing; set it to the prompts (JSONL, one {\"prompt\": ...} "
                  "per line)");
  }
  if (task.tool_server.empty()) {
    problems->Add("task.tool_server",
                  "missing or empty; set it to the tool server's argv, e.g. [\"python3\", "
                  "\"/task/tool_server.py\"]");
  }
  if (task.verifier.empty() && !task.verifier_in_tool_server) {
    problems->Add("task.verifier",
                  "missing or empty; set it to the verifier's argv, e.g. [\"python3\", "
                  "\"/task/verify.py\"], or set task.verifier_in_tool_server = true");
  }
  if (!task.verifier.empty() && task.verifier_in_tool_server) {
    problems->Add("task.verifier",
                  "is set, and so is task.verifier_in_tool_server: the rollout is scored by "
                  "one or the other; remove one");
  }
  if (task.max_tokens <= task.max_new_tokens) {
    problems->Add("task.max_tokens",
                  Cat("must be > task.max_new_tokens (", task.max_new_tokens,
                      "): it holds the prompt and every turn, got ", task.max_tokens));
  }
  if (task.focus > 0 && task.balance_by.empty()) {
    problems->Add("task.focus", "needs task.balance_by (the values it weights)");
  }
  if (task.eval_every > 0 && task.eval_prompts.empty()) {
    problems->Add("task.eval_every", "needs task.eval_prompts");
  }

  if (c->warm_start.steps > 0 && c->warm_start.traces.empty()) {
    problems->Add("warm_start.steps", Cat("is ", c->warm_start.steps,
                                          " but warm_start.traces is not set; give the traces "
                                          "or set steps = 0"));
  }

  const TrainConfig& train = c->train;
  if (train.max_tokens < task.max_tokens) {
    problems->Add("train.max_tokens",
                  Cat("must be >= task.max_tokens (", task.max_tokens,
                      "): a micro-batch holds a whole trajectory, got ", train.max_tokens));
  }
  if (static_cast<double>(train.minibatches) >
      static_cast<double>(train.groups_per_step) * c->sampling.group_size) {
    problems->Add(
        "train.minibatches",
        Cat("must be <= the rollouts per step (train.groups_per_step x "
            "sampling.group_size = ",
            train.groups_per_step * c->sampling.group_size, "), got ", train.minibatches));
  }

  const FleetConfig& fleet = c->fleet;
  if (fleet.engines == 0 && fleet.engine_urls.empty() && fleet.gateway.empty()) {
    problems->Add("fleet",
                  "no engines: set fleet.engines >= 1, fleet.engine_urls or fleet.gateway");
  }
  if (fleet.engines > 0 && !fleet.engine_urls.empty()) {
    problems->Add("fleet.engines", Cat("is ", fleet.engines,
                                       " but fleet.engine_urls is set too; set engines = 0 to "
                                       "use the existing servers alone"));
  }
  for (size_t i = 0; i < fleet.engine_urls.size(); ++i) {
    if (!IsUrl(fleet.engine_urls[i])) {
      problems->Add("fleet.engine_urls", Cat("entry ", i, " (", Quote(fleet.engine_urls[i]),
                                             ") is not an http:// or https:// URL"));
    }
  }
  if (!fleet.gateway.empty() && !IsUrl(fleet.gateway)) {
    problems->Add("fleet.gateway", Cat(Quote(fleet.gateway), " is not an http:// or https:// URL"));
  }
  const ExportConfig& ex = c->export_;
  int64_t row_tokens = ex.max_tokens > 0 ? ex.max_tokens : train.max_tokens;
  int64_t align = ex.cp > 1 ? 2 * int64_t{ex.cp} * ex.tp : (ex.sequence_parallel ? ex.tp : 1);
  int64_t longest = (task.max_tokens + align - 1) / align * align;
  if (ex.batches && row_tokens < longest) {
    problems->Add(
        ex.max_tokens > 0 ? "export.max_tokens" : "train.max_tokens",
        Cat("must be >= ", longest, " (task.max_tokens ", task.max_tokens,
            " padded to a multiple of ", align,
            " for export.cp/tp): an exported row holds a whole trajectory, got ", row_tokens));
  }
  if (fleet.kv_cache_tokens < task.max_tokens) {
    problems->Add("fleet.kv_cache_tokens",
                  Cat("must be >= task.max_tokens (", task.max_tokens,
                      "): the cache holds a whole trajectory, got ", fleet.kv_cache_tokens));
  }

  c->run.dir = Resolve(base, c->run.dir);
  c->model.path = Resolve(base, c->model.path);
  c->tokenizer.vocab = Resolve(base, c->tokenizer.vocab);
  task.prompts = Resolve(base, task.prompts);
  task.eval_prompts = Resolve(base, task.eval_prompts);
  task.files = Resolve(base, task.files);
  c->warm_start.traces = Resolve(base, c->warm_start.traces);
  c->fleet.bin_dir = Resolve(base, c->fleet.bin_dir);
  c->train.external_weights = c->train.external_weights.empty()
                                  ? c->run.dir + "/external"
                                  : Resolve(base, c->train.external_weights);

  if (!c->model.path.empty()) {
    MustExist("model.path", c->model.path, Expect::kModelDirectory, problems);
  }
  if (!c->tokenizer.vocab.empty()) {
    MustExist("tokenizer.vocab", c->tokenizer.vocab, Expect::kFile, problems);
  }
  if (!task.prompts.empty()) {
    MustExist("task.prompts", task.prompts, Expect::kFile, problems);
  }
  if (!task.eval_prompts.empty()) {
    MustExist("task.eval_prompts", task.eval_prompts, Expect::kFile, problems);
  }
  if (!task.files.empty()) {
    MustExist("task.files", task.files, Expect::kDirectory, problems);
  }
  if (!c->warm_start.traces.empty()) {
    MustExist("warm_start.traces", c->warm_start.traces, Expect::kFile, problems);
  }
}

}  // namespace

Result<Config> ParseConfig(const std::string& text, const std::string& base_dir,
                           const std::string& name) {
  toml::table root;
  try {
    root = toml::parse(text, name);
  } catch (const toml::parse_error& e) {
    const toml::source_position& at = e.source().begin;
    return absl::InvalidArgumentError(
        Cat(name, ":", at.line, ":", at.column, ": TOML syntax error: ", e.description()));
  }

  std::error_code ec;
  fs::path base = fs::absolute(base_dir.empty() ? "." : base_dir, ec);
  if (ec) {
    return absl::InvalidArgumentError(
        Cat(name, ": cannot make the base directory ", base_dir, " absolute: ", ec.message()));
  }
  base = base.lexically_normal();

  Config config;
  Problems problems(name);
  std::vector<std::unique_ptr<Section>> sections;
  ReadTables(root, &config, &problems, &sections);
  CheckUnknown(root, sections, &problems);
  // Whole-file checks on values that failed their own would only repeat those problems.
  if (!problems.empty()) {
    return problems.ToStatus();
  }
  CheckWhole(&config, base, &problems);
  if (!problems.empty()) {
    return problems.ToStatus();
  }
  config.base_dir = Resolve(base, ".");
  return config;
}

Result<Config> LoadConfig(const std::string& path) {
  Result<std::string> text = ReadFileToString(path);
  if (!text.ok()) {
    return Annotate(text.status(), "reading the configuration");
  }
  std::error_code ec;
  fs::path absolute = fs::absolute(path, ec).lexically_normal();
  if (ec) {
    return absl::InvalidArgumentError(Cat(path, ": cannot make the path absolute: ", ec.message()));
  }
  BRAGG_ASSIGN_OR_RETURN(Config config, ParseConfig(*text, absolute.parent_path().string(), path));
  config.path = absolute.string();
  return config;
}

Result<std::pair<std::string, int>> ParseHostPort(const std::string& s) {
  auto bad = [&](std::string_view why) {
    return absl::InvalidArgumentError(
        Cat("expected HOST:PORT (127.0.0.1:9400, [::1]:9400), got ", Quote(s), ": ", why));
  };
  size_t colon = s.rfind(':');
  if (colon == std::string::npos) {
    return bad("no port");
  }
  std::string host = s.substr(0, colon);
  std::string port_text = s.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  } else if (host.find(':') != std::string::npos) {
    return bad("an IPv6 address goes in brackets");
  }
  if (host.empty()) {
    return bad("no host");
  }
  int port = -1;
  if (port_text.empty() || port_text.size() > 5 ||
      !std::all_of(port_text.begin(), port_text.end(),
                   [](char ch) { return ch >= '0' && ch <= '9'; })) {
    return bad("the port is not a number");
  }
  port = std::stoi(port_text);
  if (port > 65535) {
    return bad("the port is over 65535");
  }
  return std::make_pair(host, port);
}

std::vector<std::string> ConfigKeys() {
  Config config;
  Problems problems("");
  std::vector<std::unique_ptr<Section>> sections;
  ReadTables(toml::table(), &config, &problems, &sections);
  std::vector<std::string> keys;
  for (const auto& section : sections) {
    for (const std::string& field : section->fields()) {
      keys.push_back(section->KeyPath(field));
    }
  }
  return keys;
}

}  // namespace bragg::rl
