#include "pbox/init/init_protocol.h"

#include <cstring>
#include <type_traits>

namespace bragg::pbox::init_protocol {
namespace {

constexpr char kMagic[3] = {'P', 'B', 'I'};

class Writer {
 public:
  explicit Writer(std::string* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Le(v, 2); }
  void U32(uint32_t v) { Le(v, 4); }
  void U64(uint64_t v) { Le(v, 8); }
  void I32(int32_t v) { U32(static_cast<uint32_t>(v)); }
  void I64(int64_t v) { U64(static_cast<uint64_t>(v)); }
  void Bytes(std::string_view s) { out_->append(s.data(), s.size()); }
  void Str(std::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    Bytes(s);
  }
  void StrList(const std::vector<std::string>& list) {
    size_t total = 0;
    for (const auto& s : list) {
      total += s.size() + 1;
    }
    U32(static_cast<uint32_t>(list.size()));
    U32(static_cast<uint32_t>(total));
    for (const auto& s : list) {
      Bytes(s);
      out_->push_back('\0');
    }
  }

 private:
  void Le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) {
      out_->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
    }
  }
  std::string* out_;
};

// Bounds-checked cursor; every read fails (returns false) instead of running past the end.
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  size_t left() const { return data_.size() - pos_; }
  bool U8(uint8_t* v) {
    uint64_t x;
    if (!Le(&x, 1)) {
      return false;
    }
    *v = static_cast<uint8_t>(x);
    return true;
  }
  bool U16(uint16_t* v) {
    uint64_t x;
    if (!Le(&x, 2)) {
      return false;
    }
    *v = static_cast<uint16_t>(x);
    return true;
  }
  bool U32(uint32_t* v) {
    uint64_t x;
    if (!Le(&x, 4)) {
      return false;
    }
    *v = static_cast<uint32_t>(x);
    return true;
  }
  bool U64(uint64_t* v) { return Le(v, 8); }
  bool I32(int32_t* v) {
    uint32_t x;
    if (!U32(&x)) {
      return false;
    }
    *v = static_cast<int32_t>(x);
    return true;
  }
  bool I64(int64_t* v) {
    uint64_t x;
    if (!U64(&x)) {
      return false;
    }
    *v = static_cast<int64_t>(x);
    return true;
  }
  bool Bytes(size_t n, std::string_view* out) {
    if (n > left()) {
      return false;
    }
    *out = data_.substr(pos_, n);
    pos_ += n;
    return true;
  }

 private:
  bool Le(uint64_t* v, int n) {
    if (static_cast<size_t>(n) > left()) {
      return false;
    }
    uint64_t x = 0;
    for (int i = 0; i < n; ++i) {
      x |= static_cast<uint64_t>(static_cast<uint8_t>(data_[pos_ + i])) << (8 * i);
    }
    pos_ += n;
    *v = x;
    return true;
  }
  std::string_view data_;
  size_t pos_ = 0;
};

bool HasNul(std::string_view s) { return s.find('\0') != std::string_view::npos; }

void Header(Writer& w, FrameType type, uint64_t id) {
  w.Bytes(std::string_view(kMagic, 3));
  w.U8(kVersion);
  w.U16(static_cast<uint16_t>(type));
  w.U16(0);
  w.U64(id);
}

bool Fail(std::string* error, std::string message) {
  *error = std::move(message);
  return false;
}

bool CheckList(const std::vector<std::string>& list, const char* what, std::string* error) {
  for (const auto& s : list) {
    if (HasNul(s)) {
      return Fail(error, std::string(what) + " string contains a NUL byte");
    }
  }
  return true;
}

bool EncodeOne(const SpawnFrame& f, Writer& w, std::string* error) {
  if (f.argv.empty()) {
    return Fail(error, "argv is empty");
  }
  if ((f.flags & ~kAllSpawnFlags) != 0) {
    return Fail(error, "unknown spawn flags");
  }
  if (f.cwd.size() > kMaxPathBytes) {
    return Fail(error, "cwd is longer than " + std::to_string(kMaxPathBytes) + " bytes");
  }
  if (HasNul(f.cwd)) {
    return Fail(error, "cwd contains a NUL byte");
  }
  if (!CheckList(f.argv, "argv", error) || !CheckList(f.env, "env", error)) {
    return false;
  }
  size_t bytes = ArgEnvBytes(f.argv, f.env);
  if (bytes > kMaxArgEnvBytes) {
    return Fail(error, "argv and env take " + std::to_string(bytes) + " bytes, more than the " +
                           std::to_string(kMaxArgEnvBytes) + " allowed");
  }
  Header(w, FrameType::kSpawn, f.id);
  w.U32(f.flags);
  w.Str(f.cwd);
  w.StrList(f.argv);
  w.StrList(f.env);
  return true;
}

bool EncodeOne(const KillFrame& f, Writer& w, std::string* error) {
  if (f.signal < 0 || f.signal > kMaxSignal) {
    return Fail(error, "signal " + std::to_string(f.signal) + " out of range");
  }
  Header(w, FrameType::kKill, f.id);
  w.I32(f.signal);
  w.U8(f.whole_tree ? 1 : 0);
  return true;
}

bool EncodeOne(const SpawnedFrame& f, Writer& w, std::string* error) {
  if (f.pid <= 0) {
    return Fail(error, "pid must be positive");
  }
  Header(w, FrameType::kSpawned, f.id);
  w.I32(f.pid);
  return true;
}

bool CheckMessage(const std::string& m, std::string* error) {
  if (m.size() > kMaxMessageBytes) {
    return Fail(error, "message too long");
  }
  if (HasNul(m)) {
    return Fail(error, "message contains a NUL byte");
  }
  return true;
}

bool EncodeOne(const SpawnFailedFrame& f, Writer& w, std::string* error) {
  if (f.stage != SpawnStage::kSetup && f.stage != SpawnStage::kExec) {
    return Fail(error, "unknown spawn stage");
  }
  if (!CheckMessage(f.message, error)) {
    return false;
  }
  Header(w, FrameType::kSpawnFailed, f.id);
  w.U32(static_cast<uint32_t>(f.stage));
  w.I32(f.err);
  w.I32(f.pid);
  w.Str(f.message);
  return true;
}

bool EncodeOne(const ExitedFrame& f, Writer& w, std::string* error) {
  Header(w, FrameType::kExited, f.id);
  w.I32(f.exit_code);
  w.I32(f.signal);
  w.I64(f.user_us);
  w.I64(f.system_us);
  w.I64(f.max_rss_kb);
  return true;
}

bool EncodeOne(const ErrorFrame& f, Writer& w, std::string* error) {
  if (!CheckMessage(f.message, error)) {
    return false;
  }
  Header(w, FrameType::kError, f.id);
  w.Str(f.message);
  return true;
}

bool CheckData(const std::string& data, std::string* error) {
  if (data.size() > kMaxDataBytes) {
    return Fail(error, "data of " + std::to_string(data.size()) + " bytes, more than the " +
                           std::to_string(kMaxDataBytes) + " a frame carries");
  }
  return true;
}

bool EncodeOne(const StdinFrame& f, Writer& w, std::string* error) {
  if (!CheckData(f.data, error)) {
    return false;
  }
  Header(w, FrameType::kStdin, f.id);
  w.Str(f.data);
  return true;
}

bool EncodeOne(const OutputFrame& f, Writer& w, std::string* error) {
  if (f.stream != OutputStream::kStdout && f.stream != OutputStream::kStderr) {
    return Fail(error, "unknown output stream");
  }
  if (!CheckData(f.data, error)) {
    return false;
  }
  Header(w, FrameType::kOutput, f.id);
  w.U8(static_cast<uint8_t>(f.stream));
  w.Str(f.data);
  return true;
}

bool EncodeOne(const ReadyFrame& f, Writer& w, std::string* error) {
  if (f.id != 0) {
    return Fail(error, "ready frame id must be 0");
  }
  Header(w, FrameType::kReady, 0);
  return true;
}

bool CheckCredit(uint32_t bytes, std::string* error) {
  if (bytes == 0 || bytes > kStdioWindowBytes) {
    return Fail(error, "credit of " + std::to_string(bytes) + " bytes, outside 1.." +
                           std::to_string(kStdioWindowBytes));
  }
  return true;
}

bool EncodeOne(const OutputCreditFrame& f, Writer& w, std::string* error) {
  if (f.stream != OutputStream::kStdout && f.stream != OutputStream::kStderr) {
    return Fail(error, "unknown output stream");
  }
  if (!CheckCredit(f.bytes, error)) {
    return false;
  }
  Header(w, FrameType::kOutputCredit, f.id);
  w.U8(static_cast<uint8_t>(f.stream));
  w.U32(f.bytes);
  return true;
}

bool EncodeOne(const StdinCreditFrame& f, Writer& w, std::string* error) {
  if (!CheckCredit(f.bytes, error)) {
    return false;
  }
  Header(w, FrameType::kStdinCredit, f.id);
  w.U32(f.bytes);
  return true;
}

// Reads a bytes field (any byte values) of at most kMaxDataBytes.
bool ReadData(Reader& r, std::string* out, std::string* error) {
  uint32_t len;
  std::string_view bytes;
  if (!r.U32(&len)) {
    return Fail(error, "truncated data length");
  }
  if (len > kMaxDataBytes) {
    return Fail(error, "data longer than " + std::to_string(kMaxDataBytes) + " bytes");
  }
  if (!r.Bytes(len, &bytes)) {
    return Fail(error, "data length past the end of the frame");
  }
  out->assign(bytes.data(), bytes.size());
  return true;
}

// Reads a str field of at most `max` bytes without NULs.
bool ReadStr(Reader& r, size_t max, std::string* out, std::string* error, const char* what) {
  uint32_t len;
  std::string_view bytes;
  if (!r.U32(&len)) {
    return Fail(error, std::string("truncated ") + what + " length");
  }
  if (len > max) {
    return Fail(error, std::string(what) + " longer than " + std::to_string(max) + " bytes");
  }
  if (!r.Bytes(len, &bytes)) {
    return Fail(error, std::string(what) + " length past the end of the frame");
  }
  if (HasNul(bytes)) {
    return Fail(error, std::string(what) + " contains a NUL byte");
  }
  out->assign(bytes.data(), bytes.size());
  return true;
}

bool ReadStrList(Reader& r, std::vector<std::string>* out, size_t* bytes_out, std::string* error,
                 const char* what) {
  uint32_t count;
  uint32_t len;
  std::string_view bytes;
  if (!r.U32(&count) || !r.U32(&len)) {
    return Fail(error, std::string("truncated ") + what + " header");
  }
  if (len > kMaxArgEnvBytes) {
    return Fail(error, std::string(what) + " longer than the argv+env limit");
  }
  if (!r.Bytes(len, &bytes)) {
    return Fail(error, std::string(what) + " length past the end of the frame");
  }
  // Every string ends in a NUL, so a count must equal the number of NULs, and the block must
  // end with one. This also bounds `count` by the frame size before anything is allocated.
  size_t nuls = 0;
  for (char c : bytes) {
    nuls += (c == '\0') ? 1 : 0;
  }
  if (nuls != count) {
    return Fail(error, std::string(what) + " count " + std::to_string(count) +
                           " does not match its " + std::to_string(nuls) + " strings");
  }
  if (!bytes.empty() && bytes.back() != '\0') {
    return Fail(error, std::string(what) + " does not end with a NUL");
  }
  out->clear();
  out->reserve(count);
  size_t start = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] == '\0') {
      out->emplace_back(bytes.substr(start, i - start));
      start = i + 1;
    }
  }
  *bytes_out = len;
  return true;
}

bool DecodePayload(FrameType type, uint64_t id, Reader& r, size_t num_fds, Frame* frame,
                   std::string* error) {
  switch (type) {
    case FrameType::kSpawn: {
      SpawnFrame f;
      f.id = id;
      if (!r.U32(&f.flags)) {
        return Fail(error, "truncated spawn flags");
      }
      if ((f.flags & ~kAllSpawnFlags) != 0) {
        return Fail(error, "unknown spawn flags");
      }
      size_t argv_bytes = 0;
      size_t env_bytes = 0;
      if (!ReadStr(r, kMaxPathBytes, &f.cwd, error, "cwd") ||
          !ReadStrList(r, &f.argv, &argv_bytes, error, "argv") ||
          !ReadStrList(r, &f.env, &env_bytes, error, "env")) {
        return false;
      }
      if (f.argv.empty()) {
        return Fail(error, "argv is empty");
      }
      if (argv_bytes + env_bytes > kMaxArgEnvBytes) {
        return Fail(error, "argv and env exceed the size limit");
      }
      if (num_fds != SpawnFdCount(f.flags)) {
        return Fail(error, "spawn carries " + std::to_string(num_fds) + " fds, expected " +
                               std::to_string(SpawnFdCount(f.flags)));
      }
      *frame = std::move(f);
      return true;
    }
    case FrameType::kKill: {
      KillFrame f;
      f.id = id;
      uint8_t whole = 0;
      if (!r.I32(&f.signal) || !r.U8(&whole)) {
        return Fail(error, "truncated kill frame");
      }
      if (f.signal < 0 || f.signal > kMaxSignal) {
        return Fail(error, "signal " + std::to_string(f.signal) + " out of range");
      }
      if (whole > 1) {
        return Fail(error, "whole_tree must be 0 or 1");
      }
      f.whole_tree = whole == 1;
      *frame = f;
      break;
    }
    case FrameType::kSpawned: {
      SpawnedFrame f;
      f.id = id;
      if (!r.I32(&f.pid)) {
        return Fail(error, "truncated spawned frame");
      }
      if (f.pid <= 0) {
        return Fail(error, "spawned pid must be positive");
      }
      *frame = f;
      break;
    }
    case FrameType::kSpawnFailed: {
      SpawnFailedFrame f;
      f.id = id;
      uint32_t stage;
      if (!r.U32(&stage) || !r.I32(&f.err) || !r.I32(&f.pid)) {
        return Fail(error, "truncated spawn-failed frame");
      }
      if (stage != static_cast<uint32_t>(SpawnStage::kSetup) &&
          stage != static_cast<uint32_t>(SpawnStage::kExec)) {
        return Fail(error, "unknown spawn stage " + std::to_string(stage));
      }
      f.stage = static_cast<SpawnStage>(stage);
      if (!ReadStr(r, kMaxMessageBytes, &f.message, error, "message")) {
        return false;
      }
      *frame = std::move(f);
      break;
    }
    case FrameType::kExited: {
      ExitedFrame f;
      f.id = id;
      if (!r.I32(&f.exit_code) || !r.I32(&f.signal) || !r.I64(&f.user_us) || !r.I64(&f.system_us) ||
          !r.I64(&f.max_rss_kb)) {
        return Fail(error, "truncated exited frame");
      }
      *frame = f;
      break;
    }
    case FrameType::kError: {
      ErrorFrame f;
      f.id = id;
      if (!ReadStr(r, kMaxMessageBytes, &f.message, error, "message")) {
        return false;
      }
      *frame = std::move(f);
      break;
    }
    case FrameType::kStdin: {
      StdinFrame f;
      f.id = id;
      if (!ReadData(r, &f.data, error)) {
        return false;
      }
      *frame = std::move(f);
      break;
    }
    case FrameType::kOutput: {
      OutputFrame f;
      f.id = id;
      uint8_t stream = 0;
      if (!r.U8(&stream)) {
        return Fail(error, "truncated output frame");
      }
      if (stream != static_cast<uint8_t>(OutputStream::kStdout) &&
          stream != static_cast<uint8_t>(OutputStream::kStderr)) {
        return Fail(error, "unknown output stream " + std::to_string(stream));
      }
      f.stream = static_cast<OutputStream>(stream);
      if (!ReadData(r, &f.data, error)) {
        return false;
      }
      *frame = std::move(f);
      break;
    }
    case FrameType::kReady: {
      if (id != 0) {
        return Fail(error, "ready frame id must be 0");
      }
      *frame = ReadyFrame{};
      break;
    }
    case FrameType::kOutputCredit: {
      OutputCreditFrame f;
      f.id = id;
      uint8_t stream = 0;
      if (!r.U8(&stream) || !r.U32(&f.bytes)) {
        return Fail(error, "truncated output-credit frame");
      }
      if (stream != static_cast<uint8_t>(OutputStream::kStdout) &&
          stream != static_cast<uint8_t>(OutputStream::kStderr)) {
        return Fail(error, "unknown output stream " + std::to_string(stream));
      }
      f.stream = static_cast<OutputStream>(stream);
      if (!CheckCredit(f.bytes, error)) {
        return false;
      }
      *frame = f;
      break;
    }
    case FrameType::kStdinCredit: {
      StdinCreditFrame f;
      f.id = id;
      if (!r.U32(&f.bytes)) {
        return Fail(error, "truncated stdin-credit frame");
      }
      if (!CheckCredit(f.bytes, error)) {
        return false;
      }
      *frame = f;
      break;
    }
    default:
      return Fail(error, "unknown frame type " + std::to_string(static_cast<unsigned>(type)));
  }
  if (num_fds != 0) {
    return Fail(error, std::string(FrameTypeName(type)) + " frame must not carry fds");
  }
  return true;
}

}  // namespace

std::vector<UniqueFd> TakeReceivedFds(msghdr& msg) {
  std::vector<UniqueFd> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        fds.emplace_back(fd);
      }
    }
  }
  return fds;
}

size_t SpawnFdCount(uint32_t flags) {
  if ((flags & kStreamStdio) != 0) {
    return 0;
  }
  size_t n = 0;
  for (uint32_t bit : {kStdinNull, kStdoutNull, kStderrNull}) {
    n += (flags & bit) ? 0 : 1;
  }
  return n;
}

size_t ArgEnvBytes(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  size_t n = 0;
  for (const auto& s : argv) {
    n += s.size() + 1;
  }
  for (const auto& s : env) {
    n += s.size() + 1;
  }
  return n;
}

bool EncodeFrame(const Frame& frame, std::string* out, std::string* error) {
  out->clear();
  Writer w(out);
  bool ok = std::visit([&](const auto& f) { return EncodeOne(f, w, error); }, frame);
  if (ok && out->size() > kMaxFrameBytes) {
    ok = Fail(error, "frame larger than " + std::to_string(kMaxFrameBytes) + " bytes");
  }
  if (!ok) {
    out->clear();
  }
  return ok;
}

DecodeResult DecodeFrame(std::string_view bytes, size_t num_fds) {
  DecodeResult result;
  if (bytes.size() > kMaxFrameBytes) {
    result.error = "frame larger than " + std::to_string(kMaxFrameBytes) + " bytes";
    return result;
  }
  if (num_fds > kMaxFds) {
    result.error = "too many fds (" + std::to_string(num_fds) + ")";
    return result;
  }
  Reader r(bytes);
  std::string_view magic;
  uint8_t version;
  uint16_t type;
  uint16_t reserved;
  uint64_t id;
  if (!r.Bytes(3, &magic) || !r.U8(&version) || !r.U16(&type) || !r.U16(&reserved) || !r.U64(&id)) {
    result.error = "truncated header (" + std::to_string(bytes.size()) + " bytes)";
    return result;
  }
  if (magic != std::string_view(kMagic, 3)) {
    result.error = "bad magic";
    return result;
  }
  if (version != kVersion) {
    result.error = "unsupported version " + std::to_string(version);
    return result;
  }
  if (reserved != 0) {
    result.error = "reserved header bits set";
    return result;
  }
  result.id = id;
  Frame frame;
  if (!DecodePayload(static_cast<FrameType>(type), id, r, num_fds, &frame, &result.error)) {
    return result;
  }
  if (r.left() != 0) {
    result.error = std::to_string(r.left()) + " trailing bytes after the " +
                   FrameTypeName(static_cast<FrameType>(type)) + " payload";
    return result;
  }
  result.frame = std::move(frame);
  return result;
}

std::string StreamPrefix(size_t frame_bytes) {
  std::string out;
  Writer(&out).U32(static_cast<uint32_t>(frame_bytes));
  return out;
}

namespace {

// The u32 of a stream transport length prefix (frame or program preamble).
bool PrefixLength(std::string_view prefix, const char* what, uint32_t* len, std::string* error) {
  Reader r(prefix);
  if (prefix.size() != kStreamPrefixBytes || !r.U32(len)) {
    return Fail(error, std::string(what) + " prefix must be " + std::to_string(kStreamPrefixBytes) +
                           " bytes");
  }
  return true;
}

}  // namespace

bool ParseStreamPrefix(std::string_view prefix, size_t* frame_bytes, std::string* error) {
  uint32_t len = 0;
  if (!PrefixLength(prefix, "stream", &len, error)) {
    return false;
  }
  if (len < kHeaderBytes || len > kMaxFrameBytes) {
    return Fail(error, "stream frame length " + std::to_string(len) + " outside " +
                           std::to_string(kHeaderBytes) + ".." + std::to_string(kMaxFrameBytes));
  }
  *frame_bytes = len;
  return true;
}

std::string ProgramPreamble(std::string_view program) {
  std::string out;
  Writer(&out).U32(static_cast<uint32_t>(program.size()));
  out.append(program);
  return out;
}

bool ParseProgramPrefix(std::string_view prefix, size_t* program_bytes, std::string* error) {
  uint32_t len = 0;
  if (!PrefixLength(prefix, "program", &len, error)) {
    return false;
  }
  if (len == 0 || len % 8 != 0 || len > kMaxProgramBytes) {
    return Fail(error, "seccomp program of " + std::to_string(len) +
                           " bytes: must be a multiple of 8 in 8.." +
                           std::to_string(kMaxProgramBytes));
  }
  *program_bytes = len;
  return true;
}

const char* FrameTypeName(FrameType type) {
  switch (type) {
    case FrameType::kSpawn:
      return "Spawn";
    case FrameType::kKill:
      return "Kill";
    case FrameType::kSpawned:
      return "Spawned";
    case FrameType::kSpawnFailed:
      return "SpawnFailed";
    case FrameType::kExited:
      return "Exited";
    case FrameType::kError:
      return "Error";
    case FrameType::kStdin:
      return "Stdin";
    case FrameType::kOutput:
      return "Output";
    case FrameType::kReady:
      return "Ready";
    case FrameType::kOutputCredit:
      return "OutputCredit";
    case FrameType::kStdinCredit:
      return "StdinCredit";
  }
  return "unknown";
}

}  // namespace bragg::pbox::init_protocol
