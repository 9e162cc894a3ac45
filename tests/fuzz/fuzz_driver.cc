// A libFuzzer-compatible driver for builds without libFuzzer (the normal gcc build): replays
// every file of the seed corpus, then feeds random and mutated inputs for a bounded time.
// Any crash, sanitizer report or abort fails the test the way it would under libFuzzer.
//
//   <target> [--seconds N] [--max-len BYTES] [--seed S] CORPUS_DIR_OR_FILE...
//
// When an input crashes (a signal: abort, segfault, ...), it is written to
// ./<target>-crash-input before the process dies, for replay with `<target> FILE`.

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) __attribute__((weak));

namespace {

// The input being run and where to save it if it crashes (read by the signal handler).
const std::string* g_current = nullptr;
char g_crash_path[4096];

void OnCrash(int sig) {
  if (g_current != nullptr) {
    int fd = ::open(g_crash_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ssize_t unused = ::write(fd, g_current->data(), g_current->size());
      (void)unused;
      ::close(fd);
      static const char kMsg[] = "fuzz driver: crashing input saved\n";
      unused = ::write(2, kMsg, sizeof(kMsg) - 1);
    }
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

bool ReadFile(const std::string& path, std::string* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return false;
  }
  std::ostringstream s;
  s << in.rdbuf();
  *out = s.str();
  return true;
}

void Collect(const std::string& path, std::vector<std::string>* files) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    std::cerr << "fuzz driver: cannot stat " << path << ": " << std::strerror(errno) << "\n";
    std::exit(2);
  }
  if (!S_ISDIR(st.st_mode)) {
    files->push_back(path);
    return;
  }
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) {
    std::cerr << "fuzz driver: cannot open " << path << "\n";
    std::exit(2);
  }
  std::vector<std::string> names;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') {
      names.push_back(path + "/" + e->d_name);
    }
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  for (const auto& n : names) {
    Collect(n, files);
  }
}

// Mutations in the spirit of libFuzzer's: flip, replace, insert, erase, splice, copy a span,
// and write "interesting" integers (0, -1, lengths around limits) in little-endian.
std::string Mutate(const std::string& in, const std::vector<std::string>& pool, size_t max_len,
                   std::mt19937_64& rng) {
  std::string s = in;
  int rounds = 1 + static_cast<int>(rng() % 4);
  auto pos = [&](size_t n) { return n == 0 ? 0 : static_cast<size_t>(rng() % n); };
  static const uint64_t kInteresting[] = {
      0,       1,          2,          3,          7,
      8,       15,         16,         0x7f,       0x80,
      0xff,    0x100,      0xffff,     0x10000,    0x40000,
      0x41000, 0x7fffffff, 0x80000000, 0xffffffff, 0xffffffffffffffffull};
  for (int r = 0; r < rounds; ++r) {
    switch (rng() % 8) {
      case 0:
        if (!s.empty()) {
          s[pos(s.size())] ^= static_cast<char>(1u << (rng() % 8));
        }
        break;
      case 1:
        if (!s.empty()) {
          s[pos(s.size())] = static_cast<char>(rng());
        }
        break;
      case 2:
        s.insert(pos(s.size() + 1), 1 + rng() % 8, static_cast<char>(rng()));
        break;
      case 3:
        if (!s.empty()) {
          size_t p = pos(s.size());
          s.erase(p, 1 + rng() % std::min<size_t>(16, s.size() - p));
        }
        break;
      case 4: {
        const std::string& other = pool[pos(pool.size())];
        if (!other.empty()) {
          size_t a = pos(other.size());
          size_t n = 1 + pos(other.size() - a);
          s.insert(pos(s.size() + 1), other.substr(a, n));
        }
        break;
      }
      case 5:
        if (!s.empty()) {
          size_t p = pos(s.size());
          s = s.substr(0, p) + s.substr(pos(s.size()));
        }
        break;
      case 6: {
        uint64_t v = kInteresting[pos(std::size(kInteresting))];
        size_t width = size_t{1} << (rng() % 4);
        size_t p = pos(s.size() + 1);
        std::string bytes;
        for (size_t i = 0; i < width; ++i) {
          bytes.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
        }
        s.replace(p, std::min(width, s.size() - p), bytes);
        break;
      }
      default:
        s.resize(pos(s.size() + 1));
        break;
    }
  }
  if (s.size() > max_len) {
    s.resize(max_len);
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) {
    LLVMFuzzerInitialize(&argc, &argv);
  }
  double seconds = 5;
  size_t max_len = 4096;
  uint64_t seed = std::random_device{}();
  std::vector<std::string> files;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--seconds" && i + 1 < argc) {
      seconds = std::atof(argv[++i]);
    } else if (a == "--max-len" && i + 1 < argc) {
      max_len = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (a.rfind("-", 0) == 0) {
      // libFuzzer flags (-runs=..., -max_len=...) are accepted and ignored.
    } else {
      Collect(a, &files);
    }
  }
  if (const char* env = std::getenv("FUZZ_SECONDS"); env != nullptr && *env != '\0') {
    seconds = std::atof(env);
  }
  const char* base = std::strrchr(argv[0], '/') ? std::strrchr(argv[0], '/') + 1 : argv[0];
  std::snprintf(g_crash_path, sizeof(g_crash_path), "%s-crash-input", base);
  for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL}) {
    ::signal(sig, OnCrash);
  }
  std::vector<std::string> pool;
  for (const auto& f : files) {
    std::string data;
    if (!ReadFile(f, &data)) {
      std::cerr << "fuzz driver: cannot read " << f << "\n";
      return 2;
    }
    g_current = &data;
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(data.data()), data.size());
    g_current = nullptr;
    pool.push_back(std::move(data));
  }
  std::cout << "replayed " << pool.size() << " corpus inputs" << std::endl;
  if (pool.empty()) {
    pool.emplace_back();
  }
  std::mt19937_64 rng(seed);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  uint64_t runs = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    std::string input;
    if (rng() % 16 == 0) {
      input.resize(rng() % std::min<size_t>(max_len + 1, 256));
      for (char& c : input) {
        c = static_cast<char>(rng());
      }
    } else {
      input = Mutate(pool[rng() % pool.size()], pool, max_len, rng);
    }
    g_current = &input;
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
    g_current = nullptr;
    ++runs;
    // Keep the grown inputs that are still small as material for later mutations.
    if (pool.size() < 4096 && rng() % 8 == 0) {
      pool.push_back(std::move(input));
    }
  }
  std::cout << "ran " << runs << " generated inputs in " << seconds << " s (seed " << seed << ")"
            << std::endl;
  return 0;
}
