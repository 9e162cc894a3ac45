#include "pbox/init/init_protocol.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>

namespace bragg::pbox::init_protocol {
namespace {

std::string MustEncode(const Frame& frame) {
  std::string out;
  std::string error;
  EXPECT_TRUE(EncodeFrame(frame, &out, &error)) << error;
  return out;
}

SpawnFrame SampleSpawn() {
  SpawnFrame f;
  f.id = 0x0102030405060708ull;
  f.flags = kStdinNull;
  f.cwd = "/work dir";
  f.argv = {"sh", "-c", "echo 'hi there'", ""};
  f.env = {"PATH=/bin", "A=", "B=x=y"};
  return f;
}

std::vector<Frame> SampleFrames() {
  return {
      SampleSpawn(),
      SpawnFrame{1, kAllNullFlags, "", {"true"}, {}},
      KillFrame{7, 15, true},
      KillFrame{8, 0, false},
      SpawnedFrame{9, 12345},
      SpawnFailedFrame{10, SpawnStage::kExec, ENOENT, 77, "execvp(nope): No such file"},
      SpawnFailedFrame{11, SpawnStage::kSetup, EAGAIN, 0, ""},
      ExitedFrame{12, -1, 9, 1234567, 89, 51200},
      ExitedFrame{13, 255, 0, 0, 0, 0},
      ErrorFrame{14, "bad frame: whatever"},
      SpawnFrame{15, kStreamStdio | kStderrNull, "/", {"cat"}, {}},
      StdinFrame{16, std::string("a\0b", 3)},
      StdinFrame{17, ""},
      OutputFrame{18, OutputStream::kStderr, std::string(kMaxDataBytes, 'x')},
      OutputFrame{19, OutputStream::kStdout, ""},
      ReadyFrame{},
      OutputCreditFrame{20, OutputStream::kStdout, 1},
      OutputCreditFrame{21, OutputStream::kStderr, kStdioWindowBytes},
      StdinCreditFrame{22, 65536},
  };
}

size_t FdsFor(const Frame& f) {
  if (auto* s = std::get_if<SpawnFrame>(&f)) {
    return SpawnFdCount(s->flags);
  }
  return 0;
}

TEST(InitProtocolTest, RoundTripsEveryFrameType) {
  for (const Frame& frame : SampleFrames()) {
    std::string bytes = MustEncode(frame);
    DecodeResult r = DecodeFrame(bytes, FdsFor(frame));
    ASSERT_TRUE(r.frame.has_value()) << r.error;
    ASSERT_EQ(r.frame->index(), frame.index());
    // Re-encoding the decoded frame must give the same bytes (all fields survived).
    EXPECT_EQ(MustEncode(*r.frame), bytes);
  }
}

TEST(InitProtocolTest, StreamFramesCarryNoFdsAndKeepTheirData) {
  // A streamed spawn relays its stdio: an fd beside it is refused.
  SpawnFrame streamed{1, kStreamStdio, "/", {"cat"}, {}};
  EXPECT_EQ(SpawnFdCount(streamed.flags), 0u);
  std::string bytes = MustEncode(streamed);
  EXPECT_FALSE(DecodeFrame(bytes, 1).frame.has_value());
  ASSERT_TRUE(DecodeFrame(bytes, 0).frame.has_value());

  OutputFrame out{5, OutputStream::kStdout, std::string("\0\xff\n", 3)};
  DecodeResult r = DecodeFrame(MustEncode(out), 0);
  ASSERT_TRUE(r.frame.has_value()) << r.error;
  EXPECT_EQ(std::get<OutputFrame>(*r.frame).data, out.data);
  EXPECT_EQ(std::get<OutputFrame>(*r.frame).stream, OutputStream::kStdout);

  std::string wire;
  std::string error;
  EXPECT_FALSE(EncodeFrame(StdinFrame{1, std::string(kMaxDataBytes + 1, 'a')}, &wire, &error));
  EXPECT_FALSE(EncodeFrame(OutputFrame{1, static_cast<OutputStream>(3), "x"}, &wire, &error));
  EXPECT_FALSE(EncodeFrame(ReadyFrame{4}, &wire, &error));
  // A stream number out of range on the wire is refused, as is a Ready with an id.
  std::string bad = MustEncode(OutputFrame{1, OutputStream::kStderr, "x"});
  bad[kHeaderBytes] = 7;
  EXPECT_FALSE(DecodeFrame(bad, 0).frame.has_value());
  std::string ready = MustEncode(ReadyFrame{});
  ready[8] = 1;
  EXPECT_FALSE(DecodeFrame(ready, 0).frame.has_value());
}

TEST(InitProtocolTest, StreamPrefixBoundsTheFrame) {
  size_t n = 0;
  std::string error;
  ASSERT_TRUE(ParseStreamPrefix(StreamPrefix(kMaxFrameBytes), &n, &error)) << error;
  EXPECT_EQ(n, kMaxFrameBytes);
  ASSERT_TRUE(ParseStreamPrefix(StreamPrefix(kHeaderBytes), &n, &error)) << error;
  EXPECT_EQ(n, kHeaderBytes);
  EXPECT_FALSE(ParseStreamPrefix(StreamPrefix(kMaxFrameBytes + 1), &n, &error));
  EXPECT_FALSE(ParseStreamPrefix(StreamPrefix(0), &n, &error));
  EXPECT_FALSE(ParseStreamPrefix(StreamPrefix(kHeaderBytes - 1), &n, &error));
  EXPECT_FALSE(ParseStreamPrefix(std::string("\xff\xff\xff\xff"), &n, &error));
  EXPECT_FALSE(ParseStreamPrefix(std::string("\x10\0\0"), &n, &error));
}

// The program preamble (pbox-init --isolate): a u32 length, then the program; lengths that
// are 0, not whole instructions, or over BPF_MAXINSNS instructions are refused.
TEST(InitProtocolTest, ProgramPreambleBoundsTheProgram) {
  const std::string program = "abcdefgh12345678";
  const std::string pre = ProgramPreamble(program);
  ASSERT_EQ(pre.size(), kStreamPrefixBytes + program.size());
  EXPECT_EQ(pre.substr(0, 4), std::string("\x10\x00\x00\x00", 4));
  EXPECT_EQ(pre.substr(4), program);
  size_t len = 0;
  std::string error;
  ASSERT_TRUE(ParseProgramPrefix(pre.substr(0, 4), &len, &error)) << error;
  EXPECT_EQ(len, 16u);
  ASSERT_TRUE(ParseProgramPrefix(StreamPrefix(kMaxProgramBytes), &len, &error)) << error;
  EXPECT_EQ(len, kMaxProgramBytes);
  for (size_t bad : {size_t{0}, size_t{4}, size_t{12}, kMaxProgramBytes + 8, size_t{1} << 31}) {
    error.clear();
    EXPECT_FALSE(ParseProgramPrefix(StreamPrefix(bad), &len, &error)) << bad;
    EXPECT_NE(error.find("seccomp program"), std::string::npos) << error;
  }
  EXPECT_FALSE(ParseProgramPrefix(std::string("\x08\x00\x00", 3), &len, &error));
}

TEST(InitProtocolTest, SpawnFieldsSurvive) {
  SpawnFrame in = SampleSpawn();
  DecodeResult r = DecodeFrame(MustEncode(in), SpawnFdCount(in.flags));
  ASSERT_TRUE(r.frame.has_value()) << r.error;
  const auto& out = std::get<SpawnFrame>(*r.frame);
  EXPECT_EQ(out.id, in.id);
  EXPECT_EQ(out.flags, in.flags);
  EXPECT_EQ(out.cwd, in.cwd);
  EXPECT_EQ(out.argv, in.argv);
  EXPECT_EQ(out.env, in.env);
  EXPECT_EQ(r.id, in.id);
}

TEST(InitProtocolTest, HeaderLayoutIsLittleEndian) {
  std::string b = MustEncode(SpawnedFrame{0x1122334455667788ull, 0x01020304});
  ASSERT_EQ(b.size(), kHeaderBytes + 4);
  EXPECT_EQ(b.substr(0, 3), "PBI");
  EXPECT_EQ(b[3], kVersion);
  EXPECT_EQ(static_cast<uint8_t>(b[4]), 0x81);
  EXPECT_EQ(b[5], 0);
  EXPECT_EQ(static_cast<uint8_t>(b[8]), 0x88);
  EXPECT_EQ(static_cast<uint8_t>(b[15]), 0x11);
  EXPECT_EQ(static_cast<uint8_t>(b[16]), 0x04);
}

TEST(InitProtocolTest, EncodeRefusesBadFrames) {
  std::string out;
  std::string error;
  EXPECT_FALSE(EncodeFrame(SpawnFrame{1, 0, "/", {}, {}}, &out, &error));
  EXPECT_NE(error.find("argv"), std::string::npos);
  EXPECT_FALSE(EncodeFrame(SpawnFrame{1, 0, "/", {std::string("a\0b", 3)}, {}}, &out, &error));
  EXPECT_FALSE(EncodeFrame(SpawnFrame{1, 0, std::string("/\0", 2), {"a"}, {}}, &out, &error));
  EXPECT_FALSE(EncodeFrame(SpawnFrame{1, 16, "/", {"a"}, {}}, &out, &error));
  EXPECT_FALSE(
      EncodeFrame(SpawnFrame{1, 0, std::string(kMaxPathBytes + 1, 'a'), {"a"}, {}}, &out, &error));
  EXPECT_FALSE(EncodeFrame(KillFrame{1, -1, false}, &out, &error));
  EXPECT_FALSE(EncodeFrame(KillFrame{1, kMaxSignal + 1, false}, &out, &error));
  EXPECT_FALSE(EncodeFrame(SpawnedFrame{1, 0}, &out, &error));
  EXPECT_FALSE(EncodeFrame(ErrorFrame{1, std::string(kMaxMessageBytes + 1, 'x')}, &out, &error));
  EXPECT_TRUE(out.empty());
}

// Credits are how the stdio windows reopen: a zero credit, one above the window or an unknown
// stream are refused by both sides, so that no peer can make the other's window grow.
TEST(InitProtocolTest, CreditFramesAreBounded) {
  std::string out;
  std::string error;
  EXPECT_FALSE(EncodeFrame(StdinCreditFrame{1, 0}, &out, &error));
  EXPECT_FALSE(EncodeFrame(StdinCreditFrame{1, kStdioWindowBytes + 1}, &out, &error));
  EXPECT_FALSE(EncodeFrame(OutputCreditFrame{1, OutputStream::kStdout, 0}, &out, &error));
  EXPECT_FALSE(EncodeFrame(OutputCreditFrame{1, OutputStream::kStdout, kStdioWindowBytes + 1}, &out,
                           &error));
  EXPECT_FALSE(EncodeFrame(OutputCreditFrame{1, static_cast<OutputStream>(3), 5}, &out, &error));

  // Hand-made payloads behind valid headers.
  auto with_payload = [](FrameType type, std::string payload) {
    std::string bytes = MustEncode(StdinCreditFrame{9, 1});
    bytes.resize(kHeaderBytes);
    bytes[4] = static_cast<char>(static_cast<uint16_t>(type) & 0xff);
    bytes[5] = static_cast<char>(static_cast<uint16_t>(type) >> 8);
    return bytes + payload;
  };
  auto u32 = [](uint32_t v) {
    std::string s(4, '\0');
    for (int i = 0; i < 4; ++i) {
      s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
    }
    return s;
  };
  DecodeResult ok = DecodeFrame(with_payload(FrameType::kStdinCredit, u32(4096)), 0);
  ASSERT_TRUE(ok.frame.has_value()) << ok.error;
  EXPECT_EQ(std::get<StdinCreditFrame>(*ok.frame).bytes, 4096u);
  EXPECT_EQ(std::get<StdinCreditFrame>(*ok.frame).id, 9u);
  ok = DecodeFrame(with_payload(FrameType::kOutputCredit, std::string(1, '\2') + u32(77)), 0);
  ASSERT_TRUE(ok.frame.has_value()) << ok.error;
  EXPECT_EQ(std::get<OutputCreditFrame>(*ok.frame).stream, OutputStream::kStderr);
  EXPECT_EQ(std::get<OutputCreditFrame>(*ok.frame).bytes, 77u);

  const std::string bad[] = {
      with_payload(FrameType::kStdinCredit, u32(0)),
      with_payload(FrameType::kStdinCredit, u32(kStdioWindowBytes + 1)),
      with_payload(FrameType::kStdinCredit, u32(0xffffffff)),
      with_payload(FrameType::kStdinCredit, std::string(3, '\1')),
      with_payload(FrameType::kStdinCredit, u32(1) + "x"),
      with_payload(FrameType::kOutputCredit, std::string(1, '\1') + u32(0)),
      with_payload(FrameType::kOutputCredit, std::string(1, '\1') + u32(kStdioWindowBytes + 1)),
      with_payload(FrameType::kOutputCredit, std::string(1, '\0') + u32(1)),
      with_payload(FrameType::kOutputCredit, std::string(1, '\3') + u32(1)),
      with_payload(FrameType::kOutputCredit, std::string(1, '\1') + std::string(3, '\1')),
      with_payload(FrameType::kOutputCredit, std::string(1, '\1') + u32(1) + "x"),
  };
  for (const std::string& b : bad) {
    DecodeResult r = DecodeFrame(b, 0);
    EXPECT_FALSE(r.frame.has_value());
    EXPECT_FALSE(r.error.empty());
    ASSERT_TRUE(r.id.has_value());
    EXPECT_EQ(*r.id, 9u);
  }
  // Credits never carry fds.
  EXPECT_FALSE(DecodeFrame(with_payload(FrameType::kStdinCredit, u32(1)), 1).frame.has_value());
  EXPECT_STREQ(FrameTypeName(FrameType::kStdinCredit), "StdinCredit");
  EXPECT_STREQ(FrameTypeName(FrameType::kOutputCredit), "OutputCredit");
}

TEST(InitProtocolTest, ArgEnvLimitIsExact) {
  // One argv string of n bytes takes n + 1 on the wire.
  SpawnFrame at_limit{1, kAllNullFlags, "/", {std::string(kMaxArgEnvBytes - 1, 'a')}, {}};
  std::string out;
  std::string error;
  ASSERT_TRUE(EncodeFrame(at_limit, &out, &error)) << error;
  EXPECT_LE(out.size(), kMaxFrameBytes);
  EXPECT_TRUE(DecodeFrame(out, 0).frame.has_value());

  SpawnFrame over = at_limit;
  over.env = {"X"};
  EXPECT_FALSE(EncodeFrame(over, &out, &error));
  EXPECT_NE(error.find("allowed"), std::string::npos);

  // A frame at every limit at once still fits kMaxFrameBytes.
  SpawnFrame biggest{1,
                     0,
                     std::string(kMaxPathBytes, '/'),
                     {std::string(1000, 'a')},
                     {std::string(kMaxArgEnvBytes - 1002, 'b')}};
  ASSERT_TRUE(EncodeFrame(biggest, &out, &error)) << error;
  EXPECT_LE(out.size(), kMaxFrameBytes);
  EXPECT_TRUE(DecodeFrame(out, 3).frame.has_value());
}

TEST(InitProtocolTest, FdCountMustMatch) {
  SpawnFrame f = SampleSpawn();  // stdin null: 2 fds
  std::string bytes = MustEncode(f);
  EXPECT_TRUE(DecodeFrame(bytes, 2).frame.has_value());
  for (size_t n : {0, 1, 3, 4, 253}) {
    DecodeResult r = DecodeFrame(bytes, n);
    EXPECT_FALSE(r.frame.has_value()) << n;
    EXPECT_FALSE(r.error.empty());
  }
  std::string kill = MustEncode(KillFrame{1, 9, false});
  EXPECT_TRUE(DecodeFrame(kill, 0).frame.has_value());
  DecodeResult r = DecodeFrame(kill, 1);
  EXPECT_FALSE(r.frame.has_value());
  EXPECT_EQ(r.id, 1u);  // the id is still known, so the receiver can answer
}

TEST(InitProtocolTest, EveryTruncationFails) {
  for (const Frame& frame : SampleFrames()) {
    std::string bytes = MustEncode(frame);
    for (size_t len = 0; len < bytes.size(); ++len) {
      DecodeResult r = DecodeFrame(std::string_view(bytes.data(), len), FdsFor(frame));
      EXPECT_FALSE(r.frame.has_value()) << "frame " << frame.index() << " cut at " << len;
      EXPECT_FALSE(r.error.empty());
    }
    // Trailing garbage fails too.
    EXPECT_FALSE(DecodeFrame(bytes + "x", FdsFor(frame)).frame.has_value());
  }
}

TEST(InitProtocolTest, BadHeadersFail) {
  std::string good = MustEncode(KillFrame{5, 9, false});
  auto with = [&](size_t offset, char value) {
    std::string b = good;
    b[offset] = value;
    return DecodeFrame(b, 0);
  };
  EXPECT_FALSE(with(0, 'X').frame.has_value());   // magic
  EXPECT_FALSE(with(3, 2).frame.has_value());     // version
  EXPECT_FALSE(with(4, 0x7f).frame.has_value());  // unknown type
  DecodeResult unknown = with(4, 0x7f);
  EXPECT_NE(unknown.error.find("unknown frame type"), std::string::npos);
  EXPECT_EQ(unknown.id, 5u);
  EXPECT_FALSE(with(6, 1).frame.has_value());                        // reserved
  EXPECT_FALSE(with(20, 2).frame.has_value());                       // whole_tree not 0/1
  EXPECT_FALSE(with(16, static_cast<char>(200)).frame.has_value());  // signal 200
  EXPECT_FALSE(DecodeFrame(std::string(kMaxFrameBytes + 1, 'P'), 0).frame.has_value());
}

// Overwrites 4 bytes at `offset` with a little-endian u32.
std::string Patch32(std::string b, size_t offset, uint32_t v) {
  for (int i = 0; i < 4; ++i) {
    b[offset + i] = static_cast<char>((v >> (8 * i)) & 0xff);
  }
  return b;
}

TEST(InitProtocolTest, HugeLengthsAndCountsFail) {
  SpawnFrame f{3, kAllNullFlags, "/", {"a", "bb"}, {"C=1"}};
  std::string b = MustEncode(f);
  // Layout: header(16) flags(4) cwd len(4) "/"(1) argv count(4) argv len(4) "a\0bb\0"(5) ...
  const size_t cwd_len = 20;
  const size_t argv_count = 25;
  const size_t argv_len = 29;
  const size_t env_count = 38;
  ASSERT_TRUE(DecodeFrame(b, 0).frame.has_value());
  for (uint32_t huge : {0xffffffffu, 0x80000000u, 0x7fffffffu, 1u << 20, 6u}) {
    EXPECT_FALSE(DecodeFrame(Patch32(b, cwd_len, huge), 0).frame.has_value()) << huge;
    EXPECT_FALSE(DecodeFrame(Patch32(b, argv_count, huge), 0).frame.has_value()) << huge;
    EXPECT_FALSE(DecodeFrame(Patch32(b, argv_len, huge), 0).frame.has_value()) << huge;
    EXPECT_FALSE(DecodeFrame(Patch32(b, env_count, huge), 0).frame.has_value()) << huge;
  }
  // Counts that disagree with the strings, in both directions.
  EXPECT_FALSE(DecodeFrame(Patch32(b, argv_count, 1), 0).frame.has_value());
  EXPECT_FALSE(DecodeFrame(Patch32(b, argv_count, 3), 0).frame.has_value());
  // argv with zero strings.
  SpawnFrame empty_argv_env{3, kAllNullFlags, "/", {"a"}, {}};
  std::string e = MustEncode(empty_argv_env);
  std::string no_argv = e.substr(0, argv_count) + std::string(8, '\0') + e.substr(argv_len + 4 + 2);
  DecodeResult r = DecodeFrame(no_argv, 0);
  EXPECT_FALSE(r.frame.has_value());
  EXPECT_NE(r.error.find("argv is empty"), std::string::npos) << r.error;
  // A message length past the end.
  std::string failed = MustEncode(SpawnFailedFrame{1, SpawnStage::kExec, 2, 3, "abc"});
  EXPECT_FALSE(DecodeFrame(Patch32(failed, 28, 4), 0).frame.has_value());
  EXPECT_FALSE(DecodeFrame(Patch32(failed, 28, 0xfffffff0u), 0).frame.has_value());
  EXPECT_FALSE(DecodeFrame(Patch32(failed, 16, 3), 0).frame.has_value());  // bad stage
}

TEST(InitProtocolTest, RandomBytesNeverCrash) {
  std::mt19937_64 rng(12345);
  size_t accepted = 0;
  for (int i = 0; i < 100000; ++i) {
    size_t len = rng() % 128;
    std::string b(len, '\0');
    for (auto& c : b) {
      c = static_cast<char>(rng());
    }
    // Half the frames get a valid header so the payload decoders are exercised too.
    if (i % 2 == 0 && len >= kHeaderBytes) {
      memcpy(b.data(), "PBI\x01", 4);
      const uint16_t types[] = {1, 2, 0x81, 0x82, 0x83, 0x84};
      uint16_t t = types[rng() % 6];
      b[4] = static_cast<char>(t & 0xff);
      b[5] = static_cast<char>(t >> 8);
      b[6] = b[7] = 0;
    }
    DecodeResult r = DecodeFrame(b, rng() % 5);
    if (r.frame.has_value()) {
      ++accepted;
      // Anything accepted must re-encode (it is a well-formed frame).
      std::string out;
      std::string error;
      EXPECT_TRUE(EncodeFrame(*r.frame, &out, &error)) << error;
    } else {
      EXPECT_FALSE(r.error.empty());
    }
  }
  // Pure noise essentially never forms a valid frame.
  EXPECT_LT(accepted, 5000u);
}

TEST(InitProtocolTest, MutatedValidFramesNeverCrash) {
  std::mt19937_64 rng(777);
  std::vector<std::string> seeds;
  for (const Frame& f : SampleFrames()) {
    seeds.push_back(MustEncode(f));
  }
  for (int i = 0; i < 100000; ++i) {
    std::string b = seeds[rng() % seeds.size()];
    int flips = 1 + rng() % 4;
    for (int k = 0; k < flips; ++k) {
      b[rng() % b.size()] = static_cast<char>(rng());
    }
    DecodeResult r = DecodeFrame(b, rng() % 4);
    if (!r.frame.has_value()) {
      EXPECT_FALSE(r.error.empty());
    }
  }
}

}  // namespace
}  // namespace bragg::pbox::init_protocol
