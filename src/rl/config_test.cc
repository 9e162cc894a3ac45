#include "rl/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <toml++/toml.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/fs.h"
#include "common/str_cat.h"

namespace bragg::rl {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// The keys of a TOML document as "table.key" paths (sub-tables walked, not listed).
void CollectKeys(const toml::table& table, const std::string& prefix,
                 std::vector<std::string>* out) {
  for (const auto& [key, node] : table) {
    std::string path = prefix.empty() ? std::string(key.str()) : Cat(prefix, ".", key.str());
    if (node.is_table()) {
      CollectKeys(*node.as_table(), path, out);
    } else {
      out->push_back(path);
    }
  }
}

std::set<std::string> KeysOf(const std::string& text) {
  std::vector<std::string> keys;
  CollectKeys(toml::parse(text), "", &keys);
  return {keys.begin(), keys.end()};
}

class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto dir = TempDir::Create();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = std::move(*dir);
    Write("vocab.json", "[\"a\", \"b\"]");
    Write("prompts.jsonl", "{\"prompt\": \"x\"}\n");
  }

  std::string Path(const std::string& relative) const { return Cat(dir_.path(), "/", relative); }
  void Write(const std::string& relative, const std::string& content) {
    std::string path = Path(relative);
    ASSERT_TRUE(MakeDirs(path.substr(0, path.rfind('/'))).ok());
    ASSERT_TRUE(WriteStringToFile(path, content).ok());
  }

  // A valid configuration as "table.key" -> TOML value, with `set` changed and `unset` removed,
  // written one [table] per table.
  static std::string Text(const std::vector<std::pair<std::string, std::string>>& set = {},
                          const std::vector<std::string>& unset = {}) {
    std::map<std::string, std::string> keys = {
        {"tokenizer.vocab", "\"vocab.json\""},
        {"task.prompts", "\"prompts.jsonl\""},
        {"task.tool_server", "[\"python3\", \"/task/tool_server.py\"]"},
        {"task.verifier", "[\"python3\", \"/task/verify.py\"]"},
        {"model.init.layers", "2"},
    };
    for (const auto& [key, value] : set) {
      keys[key] = value;
    }
    for (const std::string& key : unset) {
      keys.erase(key);
    }
    std::map<std::string, std::string> tables;
    for (const auto& [key, value] : keys) {
      size_t dot = key.rfind('.');
      tables[key.substr(0, dot)] += Cat(key.substr(dot + 1), " = ", value, "\n");
    }
    std::string text;
    for (const auto& [table, body] : tables) {
      text += Cat("[", table, "]\n", body);
    }
    return text;
  }

  Result<Config> Parse(const std::string& text) const {
    return ParseConfig(text, dir_.path(), "config.toml");
  }
  Result<Config> Parse(const std::vector<std::pair<std::string, std::string>>& set,
                       const std::vector<std::string>& unset = {}) const {
    return Parse(Text(set, unset));
  }

  TempDir dir_;
};

// The whole message of a refusal (InvalidArgument), "" (a failed expectation) otherwise.
std::string Refusal(const Result<Config>& result) {
  EXPECT_FALSE(result.ok());
  if (result.ok()) {
    return "";
  }
  EXPECT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  return std::string(result.status().message());
}

TEST_F(ConfigTest, MinimalConfigTakesEveryDefault) {
  auto config = Parse(Text());
  ASSERT_TRUE(config.ok()) << config.status();
  Config defaults;
  EXPECT_EQ(config->path, "");
  EXPECT_EQ(config->base_dir, dir_.path());
  EXPECT_EQ(config->run.dir, Path("rl-run"));
  EXPECT_EQ(config->run.steps, defaults.run.steps);
  EXPECT_EQ(config->tokenizer.vocab, Path("vocab.json"));
  EXPECT_EQ(config->task.prompts, Path("prompts.jsonl"));
  EXPECT_EQ(config->task.eval_prompts, "");
  EXPECT_EQ(config->task.files, "");
  EXPECT_EQ(config->task.stop, std::vector<std::string>{"\n"});
  EXPECT_EQ(config->model.path, "");
  ASSERT_TRUE(config->model.init.has_value());
  EXPECT_EQ(config->model.init->experts, ModelInit{}.experts);
  EXPECT_EQ(config->fleet.engines, defaults.fleet.engines);
  EXPECT_EQ(config->fleet.bin_dir, "");
  EXPECT_EQ(config->train.lr, defaults.train.lr);
}

// Every key set to a value other than its default comes back in its field.
TEST_F(ConfigTest, FullConfigRoundTrip) {
  Write("eval.jsonl", "{\"prompt\": \"y\"}\n");
  Write("files/tool_server.py", "");
  Write("traces.jsonl", "{}\n");
  const std::string text = R"(
[run]
dir = "out/run-7"
seed = 9223372036854775807
steps = 250
max_staleness = 0
time_limit_s = 3600.5
target_reward = 0.95
target_window = 5
checkpoint_every = 25
metrics_listen = "[::]:9400"

[model.init]
moe = false
hidden = 96
intermediate = 192
layers = 3
heads = 6
kv_heads = 3
head_dim = 32
experts = 8
top_k = 1
moe_intermediate = 48
context = 1024
std = 0.01
seed = 7

[tokenizer]
vocab = "vocab.json"

[task]
prompts = "prompts.jsonl"
eval_prompts = "eval.jsonl"
files = "files/"
image = "debian-python"
tool_server = ["python3", "/task/tool_server.py", "--fast"]
verifier = ["/task/verify"]
verifier_in_tool_server = false
setup = ["python3", "/task/tool_server.py", "--prepare"]
max_turns = 6
max_new_tokens = 48
max_tokens = 1000
stop = ["\n", "</call>"]
tool_timeout_s = 2.5
sandbox_memory_mb = 512
sandbox_pids = 128
balance_by = "element"
focus = 0.6
eval_every = 20

[sampling]
temperature = 0.7
top_p = 0.9
group_size = 4

[warm_start]
traces = "traces.jsonl"
steps = 30
batch = 16
lr = 2e-3

[train]
lr = 3e-4
groups_per_step = 16
minibatches = 4
clip_low = 0.1
clip_high = 0.3
tis_cap = 5
kl_coef = 0.01
entropy_coef = 0.001
max_grad_norm = 0.5
adam_eps = 1e-6
weight_decay = 0.01
normalize_std = false
threads = 4
max_tokens = 4096
deterministic = false
external = true
external_weights = "megatron/hf"
external_timeout_s = 90

[fleet]
engines = 0
engine_urls = ["http://10.0.0.5:30000", "https://gpu-2:30000"]
gateway = "http://10.0.0.1:8080"
engine_threads = 3
kv_cache_tokens = 32768
pbox = "unix:///run/pbox.sock"
concurrency = 64
bin_dir = "../bin"

[export]
batches = true
dp = 4
cp = 2
tp = 2
sequence_parallel = true
max_tokens = 16384
)";
  // The round trip covers every key but model.path (exclusive with [model.init]; see
  // ModelPathIsADirectoryWithConfigJson).
  std::vector<std::string> all = ConfigKeys();
  std::set<std::string> expected(all.begin(), all.end());
  expected.erase("model.path");
  EXPECT_EQ(KeysOf(text), expected);

  auto c = Parse(text);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->run.dir, Path("out/run-7"));
  EXPECT_EQ(c->run.seed, 9223372036854775807ull);
  EXPECT_EQ(c->run.steps, 250);
  EXPECT_EQ(c->run.max_staleness, 0);
  EXPECT_EQ(c->run.time_limit_s, 3600.5);
  EXPECT_EQ(c->run.target_reward, 0.95);
  EXPECT_EQ(c->run.target_window, 5);
  EXPECT_EQ(c->run.checkpoint_every, 25);
  EXPECT_EQ(c->run.metrics_listen, "[::]:9400");

  EXPECT_EQ(c->model.path, "");
  ASSERT_TRUE(c->model.init.has_value());
  const ModelInit& init = *c->model.init;
  EXPECT_FALSE(init.moe);
  EXPECT_EQ(init.hidden, 96);
  EXPECT_EQ(init.intermediate, 192);
  EXPECT_EQ(init.layers, 3);
  EXPECT_EQ(init.heads, 6);
  EXPECT_EQ(init.kv_heads, 3);
  EXPECT_EQ(init.head_dim, 32);
  EXPECT_EQ(init.experts, 8);
  EXPECT_EQ(init.top_k, 1);
  EXPECT_EQ(init.moe_intermediate, 48);
  EXPECT_EQ(init.context, 1024);
  EXPECT_EQ(init.std, 0.01f);
  EXPECT_EQ(init.seed, 7u);

  EXPECT_EQ(c->tokenizer.vocab, Path("vocab.json"));

  const TaskConfig& task = c->task;
  EXPECT_EQ(task.prompts, Path("prompts.jsonl"));
  EXPECT_EQ(task.eval_prompts, Path("eval.jsonl"));
  EXPECT_EQ(task.files, Path("files"));
  EXPECT_EQ(task.image, "debian-python");
  EXPECT_EQ(task.tool_server,
            (std::vector<std::string>{"python3", "/task/tool_server.py", "--fast"}));
  EXPECT_EQ(task.verifier, std::vector<std::string>{"/task/verify"});
  EXPECT_FALSE(task.verifier_in_tool_server);
  EXPECT_EQ(task.setup, (std::vector<std::string>{"python3", "/task/tool_server.py", "--prepare"}));
  EXPECT_EQ(task.max_turns, 6);
  EXPECT_EQ(task.max_new_tokens, 48);
  EXPECT_EQ(task.max_tokens, 1000);
  EXPECT_EQ(task.stop, (std::vector<std::string>{"\n", "</call>"}));
  EXPECT_EQ(task.tool_timeout_s, 2.5);
  EXPECT_EQ(task.sandbox_memory_mb, 512);
  EXPECT_EQ(task.sandbox_pids, 128);
  EXPECT_EQ(task.balance_by, "element");
  EXPECT_EQ(task.focus, 0.6);
  EXPECT_EQ(task.eval_every, 20);

  EXPECT_EQ(c->sampling.temperature, 0.7);
  EXPECT_EQ(c->sampling.top_p, 0.9);
  EXPECT_EQ(c->sampling.group_size, 4);

  EXPECT_EQ(c->warm_start.traces, Path("traces.jsonl"));
  EXPECT_EQ(c->warm_start.steps, 30);
  EXPECT_EQ(c->warm_start.batch, 16);
  EXPECT_EQ(c->warm_start.lr, 2e-3);

  const TrainConfig& train = c->train;
  EXPECT_EQ(train.lr, 3e-4);
  EXPECT_EQ(train.groups_per_step, 16);
  EXPECT_EQ(train.minibatches, 4);
  EXPECT_EQ(train.clip_low, 0.1);
  EXPECT_EQ(train.clip_high, 0.3);
  EXPECT_EQ(train.tis_cap, 5.0);  // an integer where a number is expected
  EXPECT_EQ(train.kl_coef, 0.01);
  EXPECT_EQ(train.entropy_coef, 0.001);
  EXPECT_EQ(train.max_grad_norm, 0.5);
  EXPECT_EQ(train.adam_eps, 1e-6);
  EXPECT_EQ(train.weight_decay, 0.01);
  EXPECT_FALSE(train.normalize_std);
  EXPECT_EQ(train.threads, 4);
  EXPECT_EQ(train.max_tokens, 4096);
  EXPECT_FALSE(train.deterministic);
  EXPECT_TRUE(train.external);
  EXPECT_EQ(train.external_weights, Path("megatron/hf"));
  EXPECT_EQ(train.external_timeout_s, 90.0);

  const FleetConfig& fleet = c->fleet;
  EXPECT_EQ(fleet.engines, 0);
  EXPECT_EQ(fleet.engine_urls,
            (std::vector<std::string>{"http://10.0.0.5:30000", "https://gpu-2:30000"}));
  EXPECT_EQ(fleet.gateway, "http://10.0.0.1:8080");
  EXPECT_EQ(fleet.engine_threads, 3);
  EXPECT_EQ(fleet.kv_cache_tokens, 32768);
  EXPECT_EQ(fleet.pbox, "unix:///run/pbox.sock");
  EXPECT_EQ(fleet.concurrency, 64);
  EXPECT_EQ(fleet.bin_dir, dir_.path().substr(0, dir_.path().rfind('/')) + "/bin");
  const ExportConfig& ex = c->export_;
  EXPECT_TRUE(ex.batches);
  EXPECT_EQ(ex.dp, 4);
  EXPECT_EQ(ex.cp, 2);
  EXPECT_EQ(ex.tp, 2);
  EXPECT_TRUE(ex.sequence_parallel);
  EXPECT_EQ(ex.max_tokens, 16384);
}

// The reference config lists every key, each at the default config.h gives it.
TEST_F(ConfigTest, ReferenceConfigStatesEveryDefault) {
  auto text = ReadFileToString(BRAGG_RL_EXAMPLE_CONFIG);
  ASSERT_TRUE(text.ok()) << text.status();
  std::vector<std::string> all = ConfigKeys();
  EXPECT_EQ(KeysOf(*text), std::set<std::string>(all.begin(), all.end()));

  auto c = ParseConfig(*text, dir_.path(), "rl-config.toml");
  ASSERT_TRUE(c.ok()) << c.status();
  const Config d;
  // The four required keys have no default: the file shows example values.
  EXPECT_EQ(c->tokenizer.vocab, Path("vocab.json"));
  EXPECT_EQ(c->task.prompts, Path("prompts.jsonl"));
  EXPECT_EQ(c->task.tool_server, (std::vector<std::string>{"python3", "/task/tool_server.py"}));
  EXPECT_EQ(c->task.verifier, (std::vector<std::string>{"python3", "/task/verify.py"}));

  EXPECT_EQ(c->run.dir, Path(d.run.dir));
  EXPECT_EQ(c->run.seed, d.run.seed);
  EXPECT_EQ(c->run.steps, d.run.steps);
  EXPECT_EQ(c->run.max_staleness, d.run.max_staleness);
  EXPECT_EQ(c->run.time_limit_s, d.run.time_limit_s);
  EXPECT_EQ(c->run.target_reward, d.run.target_reward);
  EXPECT_EQ(c->run.target_window, d.run.target_window);
  EXPECT_EQ(c->run.checkpoint_every, d.run.checkpoint_every);
  EXPECT_EQ(c->run.metrics_listen, d.run.metrics_listen);

  EXPECT_EQ(c->model.path, d.model.path);
  ASSERT_TRUE(c->model.init.has_value());
  const ModelInit& i = *c->model.init;
  const ModelInit di;
  EXPECT_EQ(i.moe, di.moe);
  EXPECT_EQ(i.hidden, di.hidden);
  EXPECT_EQ(i.intermediate, di.intermediate);
  EXPECT_EQ(i.layers, di.layers);
  EXPECT_EQ(i.heads, di.heads);
  EXPECT_EQ(i.kv_heads, di.kv_heads);
  EXPECT_EQ(i.head_dim, di.head_dim);
  EXPECT_EQ(i.experts, di.experts);
  EXPECT_EQ(i.top_k, di.top_k);
  EXPECT_EQ(i.moe_intermediate, di.moe_intermediate);
  EXPECT_EQ(i.context, di.context);
  EXPECT_EQ(i.std, di.std);
  EXPECT_EQ(i.seed, di.seed);

  EXPECT_EQ(c->task.eval_prompts, d.task.eval_prompts);
  EXPECT_EQ(c->task.files, d.task.files);
  EXPECT_EQ(c->task.image, d.task.image);
  EXPECT_EQ(c->task.verifier_in_tool_server, d.task.verifier_in_tool_server);
  EXPECT_EQ(c->task.max_turns, d.task.max_turns);
  EXPECT_EQ(c->task.max_new_tokens, d.task.max_new_tokens);
  EXPECT_EQ(c->task.max_tokens, d.task.max_tokens);
  EXPECT_EQ(c->task.stop, d.task.stop);
  EXPECT_EQ(c->task.tool_timeout_s, d.task.tool_timeout_s);
  EXPECT_EQ(c->task.sandbox_memory_mb, d.task.sandbox_memory_mb);
  EXPECT_EQ(c->task.sandbox_pids, d.task.sandbox_pids);
  EXPECT_EQ(c->task.balance_by, d.task.balance_by);
  EXPECT_EQ(c->task.focus, d.task.focus);
  EXPECT_EQ(c->task.eval_every, d.task.eval_every);

  EXPECT_EQ(c->sampling.temperature, d.sampling.temperature);
  EXPECT_EQ(c->sampling.top_p, d.sampling.top_p);
  EXPECT_EQ(c->sampling.group_size, d.sampling.group_size);

  EXPECT_EQ(c->warm_start.traces, d.warm_start.traces);
  EXPECT_EQ(c->warm_start.steps, d.warm_start.steps);
  EXPECT_EQ(c->warm_start.batch, d.warm_start.batch);
  EXPECT_EQ(c->warm_start.lr, d.warm_start.lr);

  EXPECT_EQ(c->train.lr, d.train.lr);
  EXPECT_EQ(c->train.groups_per_step, d.train.groups_per_step);
  EXPECT_EQ(c->train.minibatches, d.train.minibatches);
  EXPECT_EQ(c->train.clip_low, d.train.clip_low);
  EXPECT_EQ(c->train.clip_high, d.train.clip_high);
  EXPECT_EQ(c->train.tis_cap, d.train.tis_cap);
  EXPECT_EQ(c->train.kl_coef, d.train.kl_coef);
  EXPECT_EQ(c->train.entropy_coef, d.train.entropy_coef);
  EXPECT_EQ(c->train.max_grad_norm, d.train.max_grad_norm);
  EXPECT_EQ(c->train.adam_eps, d.train.adam_eps);
  EXPECT_EQ(c->train.weight_decay, d.train.weight_decay);
  EXPECT_EQ(c->train.normalize_std, d.train.normalize_std);
  EXPECT_EQ(c->train.threads, d.train.threads);
  EXPECT_EQ(c->train.max_tokens, d.train.max_tokens);
  EXPECT_EQ(c->train.deterministic, d.train.deterministic);
  EXPECT_EQ(c->train.external, d.train.external);
  EXPECT_EQ(c->train.external_weights, c->run.dir + "/external");
  EXPECT_EQ(c->train.external_timeout_s, d.train.external_timeout_s);

  EXPECT_EQ(c->fleet.engines, d.fleet.engines);
  EXPECT_EQ(c->fleet.engine_urls, d.fleet.engine_urls);
  EXPECT_EQ(c->fleet.gateway, d.fleet.gateway);
  EXPECT_EQ(c->fleet.engine_threads, d.fleet.engine_threads);
  EXPECT_EQ(c->fleet.kv_cache_tokens, d.fleet.kv_cache_tokens);
  EXPECT_EQ(c->fleet.pbox, d.fleet.pbox);
  EXPECT_EQ(c->fleet.concurrency, d.fleet.concurrency);
  EXPECT_EQ(c->fleet.bin_dir, d.fleet.bin_dir);
  EXPECT_EQ(c->export_.batches, d.export_.batches);
  EXPECT_EQ(c->export_.dp, d.export_.dp);
  EXPECT_EQ(c->export_.cp, d.export_.cp);
  EXPECT_EQ(c->export_.tp, d.export_.tp);
  EXPECT_EQ(c->export_.sequence_parallel, d.export_.sequence_parallel);
  EXPECT_EQ(c->export_.max_tokens, d.export_.max_tokens);
}

TEST_F(ConfigTest, SyntaxErrorsNameLineAndColumn) {
  struct Case {
    std::string text, prefix;
  };
  for (const Case& c : std::vector<Case>{
           {"[train]\nlr = = 3\n", "config.toml:2:"},
           {"[task]\nprompts = \"unterminated\n", "config.toml:2:"},
           // TOML refuses duplicate keys and tables.
           {"[train]\nlr = 1\nlr = 2\n", "config.toml:3:"},
           {"[train]\nlr = 1\n\n[train]\nthreads = 2\n", "config.toml:4:"},
           // Beyond 64 bits: refused by the TOML parser itself.
           {"[run]\nsteps = 99999999999999999999\n", "config.toml:2:"},
           {"[run]\nseed = 18446744073709551615\n", "config.toml:2:"},
       }) {
    std::string message = Refusal(Parse(c.text));
    EXPECT_THAT(message, StartsWith(c.prefix)) << c.text;
    EXPECT_THAT(message, HasSubstr("TOML syntax error: ")) << c.text;
  }
}

TEST_F(ConfigTest, WrongTypesAreRefused) {
  struct Case {
    std::string text, message;
  };
  for (const Case& c : std::vector<Case>{
           {"[train]\nlr = \"x\"\n",
            "config.toml: train.lr: expected a number, got string \"x\" (line 2)"},
           {"[run]\nsteps = \"10\"\n",
            "config.toml: run.steps: expected an integer, got string \"10\" (line 2)"},
           {"[run]\nsteps = 1.5\n",
            "config.toml: run.steps: expected an integer, got float 1.5 (line 2)"},
           {"[run]\n\nsteps = 10.0\n",
            "config.toml: run.steps: expected an integer, got float 10.0 (line 3)"},
           {"[sampling]\ngroup_size = 8e0\n",
            "config.toml: sampling.group_size: expected an integer, got float 8.0 (line 2)"},
           {"[run]\nsteps = 2026-01-01\n",
            "config.toml: run.steps: expected an integer, got date 2026-01-01 (line 2)"},
           {"[run]\nsteps = \"a\\\"b\\tc\"\n",
            "config.toml: run.steps: expected an integer, got string \"a\\\"b\\tc\" (line 2)"},
           {"[run]\nsteps = \"" + std::string(100, 'x') + "\"\n",
            "config.toml: run.steps: expected an integer, got string \"" + std::string(40, 'x') +
                "...\" (line 2)"},
           {"[task]\nimage = true\n",
            "config.toml: task.image: expected a string, got boolean true (line 2)"},
           {"[tokenizer]\nvocab = 3\n",
            "config.toml: tokenizer.vocab: expected a string, got integer 3 (line 2)"},
           {"[task]\ntool_server = { a = 1 }\n",
            "config.toml: task.tool_server: expected an array of strings, got a table (line 2)"},
           {"[task]\ntool_server = \"python3 x.py\"\n",
            "config.toml: task.tool_server: expected an array of strings, got string "
            "\"python3 x.py\" (line 2)"},
           {"[task]\nstop = [\"\\n\", 1]\n",
            "config.toml: task.stop[1]: expected a string, got integer 1 (line 2)"},
           {"[task]\nverifier = [[\"a\"]]\n",
            "config.toml: task.verifier[0]: expected a string, got an array (line 2)"},
           {"[train]\nnormalize_std = \"yes\"\n",
            "config.toml: train.normalize_std: expected a boolean (true or false), got string "
            "\"yes\" (line 2)"},
           {"[model.init]\nmoe = 1\n",
            "config.toml: model.init.moe: expected a boolean (true or false), got integer 1 "
            "(line 2)"},
           {"train = 5\n",
            "config.toml: train: expected a table ([train]), got integer 5 (line 1)"},
           {"[[train]]\nlr = 1\n",
            "config.toml: train: expected a table ([train]), got an array (line 1)"},
           {"[model]\ninit = \"small\"\n",
            "config.toml: model.init: expected a table ([model.init]), got string \"small\" "
            "(line 2)"},
       }) {
    EXPECT_EQ(Refusal(Parse(c.text)), c.message) << c.text;
  }
}

TEST_F(ConfigTest, IntegerIsTakenForANumber) {
  auto config = Parse({{"train.lr", "1"}, {"sampling.top_p", "1"}, {"model.init.std", "1"}});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->train.lr, 1.0);
  EXPECT_EQ(config->sampling.top_p, 1.0);
  EXPECT_EQ(config->model.init->std, 1.0f);
}

TEST_F(ConfigTest, UnknownTablesAndKeysAreRefused) {
  struct Case {
    std::string text, message;
  };
  for (const Case& c : std::vector<Case>{
           {"[trian]\nlr = 1\n",
            "config.toml: trian: unknown table; did you mean [train]? (line 1)"},
           {"[model_init]\nlayers = 1\n",
            "config.toml: model_init: unknown table; did you mean [model.init]? (line 1)"},
           {"[train]\ngroups_per_stp = 4\n",
            "config.toml: train.groups_per_stp: unknown key; did you mean train.groups_per_step? "
            "(line 2)"},
           {"[task]\npromts = \"p.jsonl\"\n",
            "config.toml: task.promts: unknown key; did you mean task.prompts? (line 2)"},
           {"[model.int]\nlayers = 1\n",
            "config.toml: model.int: unknown table; did you mean model.init? (line 1)"},
           // The right key in the wrong table.
           {"[train]\ngroup_size = 4\n",
            "config.toml: train.group_size: unknown key; did you mean sampling.group_size? "
            "(line 2)"},
           {"steps = 5\n[run]\n",
            "config.toml: steps: a key outside any table; did you mean run.steps or "
            "warm_start.steps? (line 1)"},
           {"[sampling]\nseed = 5\n",
            "config.toml: sampling.seed: unknown key; did you mean run.seed or "
            "model.init.seed? (line 2)"},
       }) {
    EXPECT_EQ(Refusal(Parse(c.text)), c.message) << c.text;
  }
  // Nothing close: the table's keys, or the tables, are listed.
  EXPECT_EQ(Refusal(Parse("[sampling]\nbeam_width = 4\n")),
            "config.toml: sampling.beam_width: unknown key; [sampling] has temperature, top_p, "
            "group_size (line 2)");
  EXPECT_EQ(Refusal(Parse("[logging]\nlevel = 1\n")),
            "config.toml: logging: unknown table; the tables are [run], [model], [tokenizer], "
            "[task], [sampling], [warm_start], [train], [fleet], [export] (line 1)");
  // No far-fetched suggestion for a short key.
  EXPECT_THAT(Refusal(Parse("[train]\nab = 1\n")), Not(HasSubstr("did you mean")));
  // A huge key: refused without searching for a suggestion (the search grows with its length).
  EXPECT_THAT(Refusal(Parse("[train]\n" + std::string(100000, 'k') + " = 1\n")),
              StartsWith("config.toml: train.kkkk"));
  // An unknown key in an otherwise valid file.
  EXPECT_THAT(Refusal(Parse({{"train.lrr", "1e-4"}})),
              HasSubstr("train.lrr: unknown key; did you mean train.lr?"));
}

TEST_F(ConfigTest, EveryProblemIsReportedInFileOrder) {
  std::string message = Refusal(Parse("[trian]\n[train]\nlr = \"x\"\nthreads = 1.5\n"));
  EXPECT_EQ(message,
            "config.toml: trian: unknown table; did you mean [train]? (line 1)\n"
            "config.toml: train.lr: expected a number, got string \"x\" (line 3)\n"
            "config.toml: train.threads: expected an integer, got float 1.5 (line 4)");
}

// One key out of range in an otherwise valid file: exactly one problem, this one.
TEST_F(ConfigTest, OutOfRangeValuesAreRefused) {
  struct Case {
    std::string key, value, message;
  };
  for (const Case& c : std::vector<Case>{
           {"run.seed", "-1", "run.seed: must be >= 0, got -1"},
           {"run.steps", "0", "run.steps: must be >= 1, got 0"},
           {"run.max_staleness", "-1", "run.max_staleness: must be >= 0, got -1"},
           {"run.time_limit_s", "-0.5", "run.time_limit_s: must be >= 0, got -0.5"},
           {"run.time_limit_s", "inf", "run.time_limit_s: must be a finite number, got float inf"},
           {"run.target_reward", "1.5", "run.target_reward: must be in [0, 1], got 1.5"},
           {"run.target_reward", "-0.1", "run.target_reward: must be in [0, 1], got -0.1"},
           {"run.target_window", "0", "run.target_window: must be >= 1, got 0"},
           {"run.checkpoint_every", "0", "run.checkpoint_every: must be >= 1, got 0"},
           {"run.metrics_listen", "\"localhost\"",
            "run.metrics_listen: expected HOST:PORT (127.0.0.1:9400, [::1]:9400), got "
            "\"localhost\": no port (\"\" for no /metrics)"},
           {"run.metrics_listen", "\"127.0.0.1:99999\"",
            "run.metrics_listen: expected HOST:PORT (127.0.0.1:9400, [::1]:9400), got "
            "\"127.0.0.1:99999\": the port is over 65535 (\"\" for no /metrics)"},
           {"model.init.hidden", "0", "model.init.hidden: must be >= 1, got 0"},
           {"model.init.layers", "0", "model.init.layers: must be >= 1, got 0"},
           {"model.init.layers", "3000000000",
            "model.init.layers: must be <= 2147483647 (a 32-bit integer), got 3000000000"},
           {"model.init.heads", "-2147483649", "model.init.heads: must be >= 1, got -2147483649"},
           {"model.init.experts", "0", "model.init.experts: must be >= 1, got 0"},
           {"model.init.std", "0", "model.init.std: must be > 0, got 0"},
           {"model.init.std", "1e39", "model.init.std: out of range for a 32-bit float, got 1e+39"},
           {"model.init.kv_heads", "3",
            "model.init.kv_heads: must divide model.init.heads (4), got 3"},
           {"model.init.head_dim", "15", "model.init.head_dim: must be even"},
           {"model.init.top_k", "5", "model.init.top_k: must be <= model.init.experts (4), got 5"},
           {"model.init.context", "256",
            "model.init.context: must be >= task.max_tokens (512: a whole trajectory), got 256"},
           {"task.max_turns", "0", "task.max_turns: must be >= 1, got 0"},
           {"task.max_new_tokens", "0", "task.max_new_tokens: must be >= 1, got 0"},
           {"task.max_tokens", "32",
            "task.max_tokens: must be > task.max_new_tokens (32): it holds the prompt and every "
            "turn, got 32"},
           {"task.tool_timeout_s", "0", "task.tool_timeout_s: must be > 0, got 0"},
           {"task.sandbox_memory_mb", "15", "task.sandbox_memory_mb: must be >= 16, got 15"},
           {"task.sandbox_pids", "0", "task.sandbox_pids: must be >= 1, got 0"},
           {"task.focus", "1.5", "task.focus: must be in [0, 1], got 1.5"},
           {"task.focus", "0.5", "task.focus: needs task.balance_by (the values it weights)"},
           {"task.eval_every", "-1", "task.eval_every: must be >= 0, got -1"},
           {"task.eval_every", "5", "task.eval_every: needs task.eval_prompts"},
           {"sampling.temperature", "-0.1", "sampling.temperature: must be >= 0, got -0.1"},
           {"sampling.top_p", "0", "sampling.top_p: must be in (0, 1], got 0"},
           {"sampling.top_p", "1.01", "sampling.top_p: must be in (0, 1], got 1.01"},
           {"sampling.group_size", "1", "sampling.group_size: must be >= 2, got 1"},
           {"warm_start.steps", "-1", "warm_start.steps: must be >= 0, got -1"},
           {"warm_start.steps", "10", "warm_start.steps: is 10 but warm_start.traces is not set"},
           {"warm_start.batch", "0", "warm_start.batch: must be >= 1, got 0"},
           {"warm_start.lr", "0", "warm_start.lr: must be > 0, got 0"},
           {"train.lr", "0", "train.lr: must be > 0, got 0"},
           {"train.lr", "-3e-4", "train.lr: must be > 0, got -0.0003"},
           {"train.lr", "nan", "train.lr: must be a finite number, got float nan"},
           {"train.groups_per_step", "0", "train.groups_per_step: must be >= 1, got 0"},
           {"train.minibatches", "0", "train.minibatches: must be >= 1, got 0"},
           {"train.minibatches", "65",
            "train.minibatches: must be <= the rollouts per step (train.groups_per_step x "
            "sampling.group_size = 64), got 65"},
           {"train.clip_low", "1", "train.clip_low: must be in [0, 1), got 1"},
           {"train.clip_high", "-0.1", "train.clip_high: must be in [0, 1), got -0.1"},
           {"train.tis_cap", "-1", "train.tis_cap: must be >= 0, got -1"},
           {"train.kl_coef", "-0.1", "train.kl_coef: must be >= 0, got -0.1"},
           {"train.entropy_coef", "-0.1", "train.entropy_coef: must be >= 0, got -0.1"},
           {"train.max_grad_norm", "-1", "train.max_grad_norm: must be >= 0, got -1"},
           {"train.adam_eps", "0", "train.adam_eps: must be > 0, got 0"},
           {"train.threads", "0", "train.threads: must be >= 1, got 0"},
           {"train.threads", "2147483648",
            "train.threads: must be <= 2147483647 (a 32-bit integer), got 2147483648"},
           {"train.max_tokens", "100",
            "train.max_tokens: must be >= task.max_tokens (512): a micro-batch holds a whole "
            "trajectory, got 100"},
           {"fleet.engines", "-1", "fleet.engines: must be >= 0, got -1"},
           {"fleet.engine_threads", "0", "fleet.engine_threads: must be >= 1, got 0"},
           {"fleet.kv_cache_tokens", "511",
            "fleet.kv_cache_tokens: must be >= task.max_tokens (512): the cache holds a whole "
            "trajectory, got 511"},
           {"fleet.concurrency", "0", "fleet.concurrency: must be >= 1, got 0"},
           {"fleet.engine_urls", "[\"10.0.0.5:30000\"]",
            "fleet.engine_urls: entry 0 (\"10.0.0.5:30000\") is not an http:// or https:// URL"},
           {"fleet.gateway", "\"gw:8080\"",
            "fleet.gateway: \"gw:8080\" is not an http:// or https:// URL"},
       }) {
    std::string message = Refusal(Parse({{c.key, c.value}}));
    EXPECT_THAT(message, StartsWith("config.toml: " + c.message)) << c.key << " = " << c.value;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

// An exported row holds a whole trajectory, padded for the layout; checked only when exporting.
TEST_F(ConfigTest, ExportRowMustHoldAPaddedTrajectory) {
  // task.max_tokens 512, cp 3 x tp 1: padded to a multiple of 6, 516.
  EXPECT_TRUE(Parse({{"export.cp", "3"}, {"export.max_tokens", "515"}}).ok());
  EXPECT_THAT(Refusal(Parse(
                  {{"export.batches", "true"}, {"export.cp", "3"}, {"export.max_tokens", "515"}})),
              StartsWith("config.toml: export.max_tokens: must be >= 516 (task.max_tokens 512 "
                         "padded to a multiple of 6 for export.cp/tp): an exported row holds a "
                         "whole trajectory, got 515"));
  EXPECT_TRUE(
      Parse({{"export.batches", "true"}, {"export.cp", "3"}, {"export.max_tokens", "516"}}).ok());
  // Without export.max_tokens, train.max_tokens is the row; sequence parallel pads to tp.
  EXPECT_THAT(Refusal(Parse({{"export.batches", "true"},
                             {"export.tp", "5"},
                             {"export.sequence_parallel", "true"},
                             {"train.max_tokens", "512"}})),
              StartsWith("config.toml: train.max_tokens: must be >= 515"));
  EXPECT_THAT(Refusal(Parse({{"export.dp", "0"}})),
              StartsWith("config.toml: export.dp: must be >= 1, got 0"));
}

// An external trainer trains on the exported batches: export.batches is implied, and refused
// when set false; its weights directory defaults into run.dir.
TEST_F(ConfigTest, ExternalTrainerImpliesExportedBatches) {
  auto c = Parse({{"train.external", "true"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->export_.batches);
  EXPECT_EQ(c->train.external_weights, Path("rl-run") + "/external");
  c = Parse({{"train.external", "true"}, {"train.external_weights", "\"w\""}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->train.external_weights, Path("w"));
  EXPECT_THAT(Refusal(Parse({{"train.external", "true"}, {"export.batches", "false"}})),
              HasSubstr("export.batches: must be true with train.external"));
  EXPECT_THAT(Refusal(Parse({{"train.external_timeout_s", "0"}})),
              HasSubstr("train.external_timeout_s: must be > 0"));
  auto plain = Parse(std::vector<std::pair<std::string, std::string>>{});
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->export_.batches);
}

TEST_F(ConfigTest, BoundariesAreAccepted) {
  auto config = Parse({{"run.steps", "1"},
                       {"run.max_staleness", "0"},
                       {"run.target_reward", "1"},
                       {"sampling.temperature", "0"},
                       {"sampling.top_p", "1"},
                       {"sampling.group_size", "2"},
                       {"train.clip_low", "0"},
                       {"train.clip_high", "0.999"},
                       {"train.tis_cap", "0"},
                       {"train.max_tokens", "512"},
                       {"task.max_new_tokens", "511"},
                       {"task.sandbox_memory_mb", "16"},
                       {"model.init.context", "512"},
                       {"model.init.layers", "2147483647"},
                       {"run.seed", "0"},
                       {"fleet.kv_cache_tokens", "512"}});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->model.init->layers, 2147483647);
  EXPECT_EQ(config->sampling.temperature, 0.0);
}

TEST_F(ConfigTest, RequiredKeysAreRefusedWhenMissingOrEmpty) {
  EXPECT_THAT(Refusal(Parse({}, {"task.prompts"})),
              StartsWith("config.toml: task.prompts: missing; set it to the prompts"));
  EXPECT_THAT(Refusal(Parse({}, {"tokenizer.vocab"})),
              StartsWith("config.toml: tokenizer.vocab: missing; set it to the vocabulary"));
  EXPECT_THAT(Refusal(Parse({}, {"task.tool_server"})),
              StartsWith("config.toml: task.tool_server: missing or empty; set it to the tool "
                         "server's argv"));
  EXPECT_THAT(Refusal(Parse({{"task.tool_server", "[]"}})),
              StartsWith("config.toml: task.tool_server: missing or empty"));
  EXPECT_THAT(Refusal(Parse({}, {"task.verifier"})),
              StartsWith("config.toml: task.verifier: missing or empty"));
  // The tool server may score instead, but not both.
  auto in_server = Parse({{"task.verifier_in_tool_server", "true"}}, {"task.verifier"});
  ASSERT_TRUE(in_server.ok()) << in_server.status();
  EXPECT_TRUE(in_server->task.verifier_in_tool_server);
  EXPECT_TRUE(in_server->task.verifier.empty());
  EXPECT_THAT(Refusal(Parse({{"task.verifier_in_tool_server", "true"}})),
              StartsWith("config.toml: task.verifier: is set, and so is "
                         "task.verifier_in_tool_server"));
  EXPECT_THAT(Refusal(Parse({{"task.verifier_in_tool_server", "1"}}, {"task.verifier"})),
              HasSubstr("task.verifier_in_tool_server: expected a boolean"));
  EXPECT_THAT(Refusal(Parse({{"task.prompts", "\"\""}})),
              StartsWith("config.toml: task.prompts: missing"));
  EXPECT_THAT(Refusal(Parse({{"run.dir", "\"\""}})),
              StartsWith("config.toml: run.dir: must not be empty"));
  // Every problem at once, one per line.
  std::string message = Refusal(Parse("[model.init]\n"));
  EXPECT_THAT(message, HasSubstr("tokenizer.vocab: missing"));
  EXPECT_THAT(message, HasSubstr("task.prompts: missing"));
  EXPECT_THAT(message, HasSubstr("task.tool_server: missing"));
  EXPECT_THAT(message, HasSubstr("task.verifier: missing"));
  EXPECT_EQ(std::count(message.begin(), message.end(), '\n'), 3);
}

TEST_F(ConfigTest, ArrayEntriesMustBeNonEmptyStrings) {
  EXPECT_THAT(Refusal(Parse({{"task.tool_server", "[\"python3\", \"\"]"}})),
              StartsWith("config.toml: task.tool_server[1]: must not be empty"));
  EXPECT_THAT(Refusal(Parse({{"task.verifier", "[\"\"]"}})),
              StartsWith("config.toml: task.verifier[0]: must not be empty"));
  EXPECT_THAT(Refusal(Parse({{"task.stop", "[\"\"]"}})),
              StartsWith("config.toml: task.stop[0]: must not be empty"));
  EXPECT_THAT(Refusal(Parse({{"fleet.engine_urls", "[\"\"]"}})),
              StartsWith("config.toml: fleet.engine_urls[0]: must not be empty"));
  EXPECT_THAT(Refusal(Parse({{"task.tool_server", "[\"py\\u0000thon\"]"}})),
              StartsWith("config.toml: task.tool_server[0]: must not contain a NUL character"));
  EXPECT_THAT(Refusal(Parse({{"task.image", "\"a\\u0000b\""}})),
              StartsWith("config.toml: task.image: must not contain a NUL character"));
  // No stop strings: a turn ends at max_new_tokens.
  auto config = Parse({{"task.stop", "[]"}});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->task.stop.empty());
}

TEST_F(ConfigTest, ModelIsEitherPathOrInit) {
  EXPECT_THAT(Refusal(Parse({}, {"model.init.layers"})),
              StartsWith("config.toml: model: neither model.path (a Hugging Face directory) nor "
                         "[model.init]"));
  Write("qwen/config.json", "{}");
  EXPECT_THAT(Refusal(Parse({{"model.path", "\"qwen\""}})),
              StartsWith("config.toml: model: both model.path and [model.init] are set; keep "
                         "one"));
}

TEST_F(ConfigTest, ModelPathIsADirectoryWithConfigJson) {
  Write("qwen/config.json", "{}");
  Write("empty/.keep", "");
  auto config = Parse({{"model.path", "\"./qwen/\""}}, {"model.init.layers"});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->model.path, Path("qwen"));
  EXPECT_FALSE(config->model.init.has_value());

  EXPECT_THAT(Refusal(Parse({{"model.path", "\"nope\""}}, {"model.init.layers"})),
              StartsWith(Cat("config.toml: model.path: ", Path("nope"), " does not exist (line ")));
  EXPECT_THAT(Refusal(Parse({{"model.path", "\"empty\""}}, {"model.init.layers"})),
              StartsWith(Cat("config.toml: model.path: ", Path("empty"),
                             " has no config.json (expected a Hugging Face model directory)")));
  EXPECT_THAT(
      Refusal(Parse({{"model.path", "\"vocab.json\""}}, {"model.init.layers"})),
      StartsWith(Cat("config.toml: model.path: ", Path("vocab.json"), " is not a directory")));
}

TEST_F(ConfigTest, RelativePathsResolveAgainstTheBaseDirectory) {
  Write("data/prompts.jsonl", "{}\n");
  Write("data/eval.jsonl", "{}\n");
  Write("conf/vocab.json", "[]");
  Write("task/x.py", "");
  Write("traces.jsonl", "{}\n");
  std::string text = Text({{"tokenizer.vocab", "\"vocab.json\""},
                           {"task.prompts", "\"../data/prompts.jsonl\""},
                           {"task.eval_prompts", Cat("\"", Path("data/eval.jsonl"), "\"")},
                           {"task.files", "\"../task/.\""},
                           {"warm_start.traces", "\"./../traces.jsonl\""},
                           {"warm_start.steps", "3"},
                           {"run.dir", "\"runs//a/\""},
                           {"fleet.bin_dir", "\"../../bin\""}});
  // A base directory with ".", ".." and a trailing '/' in it.
  auto config = ParseConfig(text, Cat(dir_.path(), "/conf/./../conf/"), "config.toml");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->base_dir, Path("conf"));
  EXPECT_EQ(config->tokenizer.vocab, Path("conf/vocab.json"));
  EXPECT_EQ(config->task.prompts, Path("data/prompts.jsonl"));
  EXPECT_EQ(config->task.eval_prompts, Path("data/eval.jsonl"));
  EXPECT_EQ(config->task.files, Path("task"));
  EXPECT_EQ(config->warm_start.traces, Path("traces.jsonl"));
  EXPECT_EQ(config->run.dir, Path("conf/runs/a"));
  EXPECT_EQ(config->fleet.bin_dir, dir_.path().substr(0, dir_.path().rfind('/')) + "/bin");
}

TEST_F(ConfigTest, FilesThatMustExistAreChecked) {
  Write("dir/file", "");
  struct Case {
    std::string key, value, message;
  };
  for (const Case& c : std::vector<Case>{
           {"tokenizer.vocab", "missing.json", Cat(Path("missing.json"), " does not exist")},
           {"tokenizer.vocab", "dir", Cat(Path("dir"), " is a directory, expected a file")},
           {"task.prompts", "missing.jsonl", Cat(Path("missing.jsonl"), " does not exist")},
           {"task.eval_prompts", "eval.jsonl", Cat(Path("eval.jsonl"), " does not exist")},
           {"task.files", "files", Cat(Path("files"), " does not exist")},
           {"task.files", "dir/file", Cat(Path("dir/file"), " is not a directory")},
           {"warm_start.traces", "/nonexistent/traces.jsonl",
            "/nonexistent/traces.jsonl does not exist"},
           // A path through a file.
           {"task.prompts", "dir/file/x", Cat(Path("dir/file/x"), " does not exist")},
       }) {
    std::string message = Refusal(Parse({{c.key, Cat("\"", c.value, "\"")}}));
    EXPECT_THAT(message, StartsWith(Cat("config.toml: ", c.key, ": ", c.message, " (line ")))
        << c.key;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  // Created later, never checked.
  EXPECT_TRUE(Parse({{"run.dir", "\"/nonexistent/run\""}, {"fleet.bin_dir", "\"nobin\""}}).ok());
}

TEST_F(ConfigTest, FleetNeedsEngines) {
  EXPECT_THAT(Refusal(Parse({{"fleet.engines", "0"}})),
              StartsWith("config.toml: fleet: no engines: set fleet.engines >= 1, "
                         "fleet.engine_urls or fleet.gateway (line "));
  auto urls = Parse({{"fleet.engine_urls", "[\"http://a:1\"]"}});
  ASSERT_TRUE(urls.ok()) << urls.status();
  EXPECT_EQ(urls->fleet.engines, 0);  // existing servers replace the local engines
  EXPECT_THAT(Refusal(Parse({{"fleet.engine_urls", "[\"http://a:1\"]"}, {"fleet.engines", "2"}})),
              StartsWith("config.toml: fleet.engines: is 2 but fleet.engine_urls is set too"));
  auto gateway = Parse({{"fleet.engines", "0"}, {"fleet.gateway", "\"https://gw:8080\""}});
  ASSERT_TRUE(gateway.ok()) << gateway.status();
  EXPECT_EQ(gateway->fleet.engines, 0);
}

TEST_F(ConfigTest, LoadConfigResolvesAgainstTheFilesDirectory) {
  Write("conf/vocab.json", "[]");
  Write("conf/rl.toml", Text({{"task.prompts", "\"../prompts.jsonl\""}}));
  auto config = LoadConfig(Path("conf/rl.toml"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->path, Path("conf/rl.toml"));
  EXPECT_EQ(config->base_dir, Path("conf"));
  EXPECT_EQ(config->tokenizer.vocab, Path("conf/vocab.json"));
  EXPECT_EQ(config->task.prompts, Path("prompts.jsonl"));

  // Problems name the file as given.
  Write("conf/bad.toml", "[train]\nlr = -1\n");
  auto bad = LoadConfig(Path("conf/bad.toml"));
  EXPECT_EQ(Refusal(bad), Cat(Path("conf/bad.toml"), ": train.lr: must be > 0, got -1 (line 2)"));
}

TEST_F(ConfigTest, LoadConfigNamesAFileItCannotRead) {
  auto missing = LoadConfig(Path("missing.toml"));
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(Path("missing.toml")));

  auto directory = LoadConfig(dir_.path());
  ASSERT_FALSE(directory.ok());
  EXPECT_THAT(directory.status().message(), HasSubstr(dir_.path()));
}

TEST_F(ConfigTest, ConfigKeysListsEveryTable) {
  std::vector<std::string> keys = ConfigKeys();
  EXPECT_EQ(keys.front(), "run.dir");
  EXPECT_EQ(keys.back(), "export.max_tokens");
  EXPECT_NE(std::find(keys.begin(), keys.end(), "run.metrics_listen"), keys.end());
  EXPECT_NE(std::find(keys.begin(), keys.end(), "model.init.moe_intermediate"), keys.end());
  EXPECT_EQ(std::find(keys.begin(), keys.end(), "model.init"), keys.end());
  EXPECT_EQ(std::set<std::string>(keys.begin(), keys.end()).size(), keys.size());
}

}  // namespace
}  // namespace bragg::rl
