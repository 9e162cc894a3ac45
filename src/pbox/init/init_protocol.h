#pragma once

// Wire format of the channel between the agent (InitClient) and pbox-init.
//
// Pure encode/decode functions: no I/O, no allocation larger than the frame being decoded, and
// only the C++ standard library (pbox-init links this statically, and fuzzers can drive it).
//
// Transports:
//   seqpacket (native runtime): an AF_UNIX SOCK_SEQPACKET socketpair; one message carries
//     exactly one frame, and Spawn passes the command's stdio as SCM_RIGHTS fds.
//   stream (gVisor runtime, where fds cannot cross into the sandbox): a byte stream in each
//     direction (pbox-init's stdin and stdout); every frame is preceded by its length as a
//     u32 (kStreamPrefixBytes), and the command's stdio travels as Stdin/Output frames
//     (Spawn flag kStreamStdio). pbox-init sends Ready once when it serves.
//     Under `pbox-init --stream --isolate` the agent's first bytes, ahead of any frame, are the
//     program preamble: a u32 byte length, then that many bytes of a classic BPF seccomp
//     program (struct sock_filter[]; a multiple of 8 bytes, 1..BPF_MAXINSNS instructions),
//     which pbox-init loads for the commands (init_pid_namespace.h). The program travels on
//     the channel rather than as a file bound into the sandbox: under gVisor that bind mount,
//     and pbox-init's unmounting it, cost about 3 ms of every create.
// Every integer is little-endian.
//
// Header (16 bytes):
//   offset 0  u8[3]  magic "PBI"
//   offset 3  u8     version (kVersion = 1)
//   offset 4  u16    type (FrameType)
//   offset 6  u16    reserved, must be 0
//   offset 8  u64    id: the process id chosen by the agent (request id of Spawn/Kill; the
//                    answers carry the id of the Spawn they answer)
//
// Field encodings used by the payloads:
//   str      u32 length, then that many bytes (no NUL bytes allowed)
//   strlist  u32 count, u32 byte length, then `count` NUL-terminated strings filling exactly
//            that many bytes (so the strings can be handed to execve as they are)
//
// Payloads (nothing may follow the last field):
//   agent -> init
//     Spawn (1)        u32 flags, str cwd, strlist argv (count >= 1), strlist env.
//                      flags bit 0/1/2: stdin/stdout/stderr is /dev/null (opened by init);
//                      bit 3 (kStreamStdio): the streams whose bit is clear are pipes that
//                      init relays as Stdin/Output frames (stream transport); other bits
//                      must be 0. Without bit 3 the message carries one SCM_RIGHTS fd for
//                      each stream whose bit is clear, in the order stdin, stdout, stderr.
//                      argv bytes + env bytes <= kMaxArgEnvBytes; cwd <= kMaxPathBytes.
//     Kill (2)         i32 signal (0..kMaxSignal), u8 whole_tree (0 or 1).
//     Stdin (3)        bytes data (<= kMaxDataBytes): for the command's stdin; empty: close it.
//                      Flow control: at most kStdioWindowBytes of a command's stdin may be
//                      sent and not yet credited back by StdinCredit; init refuses a sender
//                      that exceeds it (Error frame; the command's stdin is closed).
//     OutputCredit (4) u8 stream (1 stdout, 2 stderr), u32 bytes (1..kStdioWindowBytes): the
//                      agent handed that many bytes of the stream's Output on to its reader.
//   init -> agent
//     Spawned (0x81)     i32 pid (> 0): the program was exec'd.
//     SpawnFailed (0x82) u32 stage, i32 errno, i32 pid, str message (<= kMaxMessageBytes).
//                        stage 1 (kSetup): no process was started (pid 0), e.g. fork failed.
//                        stage 2 (kExec): the forked child could not chdir or exec; it exited
//                        with 127 and has been (or will be) reaped by init.
//     Exited (0x83)      i32 exit_code (-1 when killed), i32 signal (0 when exited),
//                        i64 user_us, i64 system_us, i64 max_rss_kb (wait4 rusage).
//     Error (0x84)       str message: a frame with this id was refused (malformed, duplicate
//                        id, ...).
//     Output (0x85)      u8 stream (1 stdout, 2 stderr), bytes data (<= kMaxDataBytes): what
//                        the command wrote; empty: that stream reached EOF. All output a
//                        process wrote before it exited precedes its Exited frame.
//     Ready (0x86)       empty payload, id 0: init serves (stream transport only).
//     StdinCredit (0x87) u32 bytes (1..kStdioWindowBytes): init wrote (or, once the command's
//                        stdin is closed, dropped) that many bytes of the command's Stdin
//                        data; the agent may send that many more.
//
// Flow control (stream transport): each direction of each command's stdio has a window of
// kStdioWindowBytes, as in HTTP/2 or SSH channels. The agent sends at most that many stdin
// bytes ahead of init's StdinCredit; init sends at most that many bytes of a stream's Output
// ahead of the agent's OutputCredit and, when the window is full, stops reading the command's
// pipe (the command blocks, as on a pipe of the native runtime). Credits are batched (once a
// quarter of the window is consumed, or when the consumer's buffer empties). Empty Stdin and
// Output frames (EOF) take no window. A credit that would raise a window above
// kStdioWindowBytes is refused.
//
// `bytes` is a u32 length and that many bytes of any value (NULs allowed).
//
// Frames larger than kMaxFrameBytes are refused by both sides.

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/unique_fd.h"

namespace bragg::pbox::init_protocol {

inline constexpr uint8_t kVersion = 1;
inline constexpr size_t kHeaderBytes = 16;
// Sum of the strlist byte lengths of argv and env (each string counts its NUL).
inline constexpr size_t kMaxArgEnvBytes = 256 * 1024;
inline constexpr size_t kMaxPathBytes = 4096;
inline constexpr size_t kMaxMessageBytes = 4096;
inline constexpr int kMaxSignal = 64;
// Largest Stdin/Output payload.
inline constexpr size_t kMaxDataBytes = 64 * 1024;
// Length prefix of every frame on the stream transport.
inline constexpr size_t kStreamPrefixBytes = 4;
// Largest frame either side sends or accepts: a Spawn at its limits.
inline constexpr size_t kMaxFrameBytes =
    kHeaderBytes + 4 + (4 + kMaxPathBytes) + 2 * 8 + kMaxArgEnvBytes;
// Spawn carries at most this many fds; every other frame carries none.
inline constexpr size_t kMaxFds = 3;

enum class FrameType : uint16_t {
  kSpawn = 1,
  kKill = 2,
  kStdin = 3,
  kOutputCredit = 4,
  kSpawned = 0x81,
  kSpawnFailed = 0x82,
  kExited = 0x83,
  kError = 0x84,
  kOutput = 0x85,
  kReady = 0x86,
  kStdinCredit = 0x87,
};

inline constexpr uint32_t kStdinNull = 1u << 0;
inline constexpr uint32_t kStdoutNull = 1u << 1;
inline constexpr uint32_t kStderrNull = 1u << 2;
inline constexpr uint32_t kAllNullFlags = kStdinNull | kStdoutNull | kStderrNull;
inline constexpr uint32_t kStreamStdio = 1u << 3;
inline constexpr uint32_t kAllSpawnFlags = kAllNullFlags | kStreamStdio;

enum class SpawnStage : uint32_t {
  kSetup = 1,
  kExec = 2,
};

struct SpawnFrame {
  uint64_t id = 0;
  uint32_t flags = 0;  // k*Null bits
  std::string cwd;
  std::vector<std::string> argv;
  std::vector<std::string> env;
};

struct KillFrame {
  uint64_t id = 0;
  int32_t signal = 0;
  bool whole_tree = false;
};

struct SpawnedFrame {
  uint64_t id = 0;
  int32_t pid = 0;
};

struct SpawnFailedFrame {
  uint64_t id = 0;
  SpawnStage stage = SpawnStage::kSetup;
  int32_t err = 0;
  int32_t pid = 0;
  std::string message;
};

struct ExitedFrame {
  uint64_t id = 0;
  int32_t exit_code = -1;
  int32_t signal = 0;
  int64_t user_us = 0;
  int64_t system_us = 0;
  int64_t max_rss_kb = 0;
};

struct ErrorFrame {
  uint64_t id = 0;
  std::string message;
};

struct StdinFrame {
  uint64_t id = 0;
  std::string data;  // empty: EOF
};

enum class OutputStream : uint8_t {
  kStdout = 1,
  kStderr = 2,
};

struct OutputFrame {
  uint64_t id = 0;
  OutputStream stream = OutputStream::kStdout;
  std::string data;  // empty: EOF
};

struct ReadyFrame {
  uint64_t id = 0;
};

struct OutputCreditFrame {
  uint64_t id = 0;
  OutputStream stream = OutputStream::kStdout;
  uint32_t bytes = 0;  // 1..kStdioWindowBytes
};

struct StdinCreditFrame {
  uint64_t id = 0;
  uint32_t bytes = 0;  // 1..kStdioWindowBytes
};

using Frame =
    std::variant<SpawnFrame, KillFrame, SpawnedFrame, SpawnFailedFrame, ExitedFrame, ErrorFrame,
                 StdinFrame, OutputFrame, ReadyFrame, OutputCreditFrame, StdinCreditFrame>;

// Number of fds a Spawn frame with `flags` must carry (one per stream that is not /dev/null;
// none with kStreamStdio).
size_t SpawnFdCount(uint32_t flags);

// Every fd the SCM_RIGHTS control messages of a received `msg` carry, each owned, so that
// none leaks whatever the caller then makes of the frame.
std::vector<UniqueFd> TakeReceivedFds(msghdr& msg);

// Bytes that argv and env occupy on the wire (each string plus its NUL), compared against
// kMaxArgEnvBytes.
size_t ArgEnvBytes(const std::vector<std::string>& argv, const std::vector<std::string>& env);

// Encodes `frame` into `*out` (replacing its contents). Returns false and sets `*error` when
// the frame cannot be sent: a string holds a NUL byte, empty argv, limits exceeded, a signal
// or stage out of range. Never throws except std::bad_alloc. Thread-compatible.
[[nodiscard]] bool EncodeFrame(const Frame& frame, std::string* out, std::string* error);

struct DecodeResult {
  std::optional<Frame> frame;  // set on success
  std::string error;           // set on failure
  // The header's id when the header itself was readable (even if the payload was not), so
  // that the receiver can answer with an Error frame.
  std::optional<uint64_t> id;
};

// Decodes one frame of `bytes` that arrived with `num_fds` SCM_RIGHTS fds. Strict: wrong
// magic/version/reserved bits, unknown types, truncated fields, lengths past the end, trailing
// bytes, limits exceeded, and an fd count that does not match the frame all fail. Never
// crashes on any input and never allocates more than bytes.size() plus small constants.
// Thread-compatible.
DecodeResult DecodeFrame(std::string_view bytes, size_t num_fds);

// Stream transport: the flow-control window of each direction of each command's stdio
// (bytes sent and not yet credited back). Four full frames keep the pipe between gVisor and
// the agent busy while credits travel back.
inline constexpr size_t kStdioWindowBytes = 256 * 1024;
// Credits are sent once this much is consumed (or the consumer's buffer is empty).
inline constexpr size_t kStdioCreditBatchBytes = kStdioWindowBytes / 4;
// Stream transport: the 4-byte length prefix of a frame of `frame_bytes` bytes.
std::string StreamPrefix(size_t frame_bytes);
// Stream transport: parses a length prefix (exactly kStreamPrefixBytes bytes). Returns false
// and sets `*error` when the length is 0 or over kMaxFrameBytes: the stream cannot be trusted
// after that and must be closed.
[[nodiscard]] bool ParseStreamPrefix(std::string_view prefix, size_t* frame_bytes,
                                     std::string* error);

// Largest program preamble body: BPF_MAXINSNS (4096) instructions of 8 bytes.
inline constexpr size_t kMaxProgramBytes = 4096 * 8;
// The program preamble for `program` (its bytes, 1..kMaxProgramBytes, a multiple of 8).
std::string ProgramPreamble(std::string_view program);
// Parses the preamble's length (exactly kStreamPrefixBytes bytes) into `*program_bytes`.
// Returns false and sets `*error` when it is 0, not a multiple of 8 or over kMaxProgramBytes.
[[nodiscard]] bool ParseProgramPrefix(std::string_view prefix, size_t* program_bytes,
                                      std::string* error);

// "Spawn", "Kill", ...; "unknown" for anything else.
const char* FrameTypeName(FrameType type);

}  // namespace bragg::pbox::init_protocol
