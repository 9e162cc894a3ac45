#include "reshard/pickle.h"

#include <gtest/gtest.h>

#include <random>

#include "reshard/test_util.h"

namespace bragg::reshard {
namespace {

using testing::FromHex;
using namespace std::string_literals;

// pickle.dumps({"a": [1, -2, 300, 70000, 2**40, -2**63], "b": (1.5, "héllo", b"\x00\xff"),
//               "c": {1, 2}, "d": None, "e": True, "f": OrderedDict(x=1)}, protocol=4)
constexpr std::string_view kProto4 =
    "8004958d000000000000007d94288c0161945d94284b014afeffffff4d2c014a701101008a06000000000001"
    "8a080000000000000080658c016294473ff80000000000008c0668c3a96c6c6f94430200ff9487948c016394"
    "8f94284b014b02908c0164944e8c016594888c0166948c0b636f6c6c656374696f6e73948c0b4f7264657265"
    "64446963749493942952948c0178944b0173752e";
// pickle.dumps([("x", 1)] * 3, protocol=5): memo sharing through BINGET.
constexpr std::string_view kProto5 = "80059511000000000000005d94288c0178944b01869468026802652e";
// pickle.dumps({"k": b"\x00\x01", "t": (1, 2, 3)}, protocol=2): bytes via _codecs.encode.
constexpr std::string_view kProto2 =
    "80027d71002858010000006b7101635f636f646563730a656e636f64650a710258020000000001710358060000"
    "006c6174696e31710486710552710658010000007471074b014b024b03877108752e";

TEST(PickleTest, Protocol4Values) {
  std::string data = FromHex(kProto4);
  auto doc = ParsePickle(data);
  ASSERT_TRUE(doc.ok()) << doc.status();
  const PyValue* r = doc->root();
  ASSERT_EQ(r->kind, PyValue::Kind::kDict);
  auto a = AsIntList(r->Get("a"), "a");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, (std::vector<int64_t>{1, -2, 300, 70000, int64_t{1} << 40, INT64_MIN}));
  const PyValue* b = r->Get("b");
  ASSERT_EQ(b->kind, PyValue::Kind::kTuple);
  ASSERT_EQ(b->items.size(), 3u);
  EXPECT_DOUBLE_EQ(b->items[0]->f, 1.5);
  EXPECT_EQ(b->items[1]->s, "h\xc3\xa9llo");
  EXPECT_EQ(b->items[2]->kind, PyValue::Kind::kBytes);
  EXPECT_EQ(b->items[2]->s, std::string("\x00\xff", 2));
  EXPECT_EQ(r->Get("c")->kind, PyValue::Kind::kSet);
  EXPECT_EQ(r->Get("c")->items.size(), 2u);
  EXPECT_TRUE(r->Get("d")->IsNone());
  EXPECT_TRUE(r->Get("e")->b);
  // OrderedDict() is allowed and becomes a plain dict filled by SETITEMS.
  ASSERT_EQ(r->Get("f")->kind, PyValue::Kind::kDict);
  EXPECT_EQ(r->Get("f")->Get("x")->i, 1);
  EXPECT_EQ(r->Get("missing"), nullptr);
}

TEST(PickleTest, Protocol5MemoSharing) {
  std::string data = FromHex(kProto5);
  auto doc = ParsePickle(data);
  ASSERT_TRUE(doc.ok()) << doc.status();
  ASSERT_EQ(doc->root()->items.size(), 3u);
  EXPECT_EQ(doc->root()->items[0], doc->root()->items[2]);
  EXPECT_EQ(doc->root()->items[1]->items[0]->s, "x");
}

TEST(PickleTest, Protocol2CodecsBytes) {
  std::string data = FromHex(kProto2);
  auto doc = ParsePickle(data);
  ASSERT_TRUE(doc.ok()) << doc.status();
  const PyValue* k = doc->root()->Get("k");
  ASSERT_EQ(k->kind, PyValue::Kind::kBytes);
  EXPECT_EQ(k->s, std::string("\x00\x01", 2));
  EXPECT_EQ(*AsIntList(doc->root()->Get("t"), "t"), (std::vector<int64_t>{1, 2, 3}));
}

TEST(PickleTest, UnknownGlobalsAreStubsAndNothingRuns) {
  // os.system("echo pwned") as protocol 2: GLOBAL, args tuple, REDUCE.
  std::string data =
      "\x80\x02"
      "cos\nsystem\n"
      "X\x0a\x00\x00\x00"
      "echo pwned"
      "\x85"
      "R."s;
  auto doc = ParsePickle(data);
  ASSERT_TRUE(doc.ok()) << doc.status();
  const PyValue* r = doc->root();
  ASSERT_EQ(r->kind, PyValue::Kind::kObject);
  EXPECT_FALSE(r->callable->allowed);
  EXPECT_EQ(r->callable->s, "os.system");
  EXPECT_FALSE(r->IsObjectOf("os.system"));
  EXPECT_EQ(DescribeValue(r), "<stub os.system>('echo pwned')");
  EXPECT_TRUE(IsAllowedGlobal("torch._utils._rebuild_tensor_v2"));
  EXPECT_TRUE(IsAllowedGlobal("torch.distributed.checkpoint.metadata.Metadata"));
  EXPECT_FALSE(IsAllowedGlobal("builtins.eval"));
}

TEST(PickleTest, RejectsMalformedInput) {
  struct Case {
    std::string data;
    std::string_view expect;
  };
  const Case cases[] = {
      {"", "no STOP"},
      {"\x80\x02", "no STOP"},
      {"\x80\x09N.", "protocol 9"},
      {"\x80\x02.", "STOP with 0 values"},
      {"\x80\x02NN.", "STOP with 2 values"},
      {"\x80\x02"
       "0.",
       "underflow"},
      {"\x80\x02(0N.", "underflow"},
      {"\x80\x02t.", "no MARK"},
      {"\x80\x02h\x05.", "memo key 5"},
      {std::string("\x80\x02X\xff\xff\xff\x7f", 7), "truncated"},
      {std::string("\x80\x04\x8e\xff\xff\xff\xff\xff\xff\xff\xff", 11), "truncated"},
      {"\x80\x02"
       "cos\n",
       "missing newline"},
      {"\x80\x02"
       "io\nN.",
       "unsupported opcode 0x69"},
      {"\x80\x02\x97.", "unsupported opcode 0x97"},
      {"\x80\x02\x82\x01.", "unsupported opcode 0x82"},
      {"\x80\x02K\x01K\x02"
       "a.",
       "not a list"},
      {"\x80\x02}K\x01s.", "underflow"},
      {"\x80\x02\x8a\x09\x01\x01\x01\x01\x01\x01\x01\x01\x01.", "64 bits"},
      {"\x80\x02N\x93.", "underflow"},
      {"\x80\x02K\x01K\x02\x93.", "two strings"},
      {"\x80\x02K\x01K\x02R.", "not a tuple"},
  };
  for (const Case& c : cases) {
    auto doc = ParsePickle(c.data);
    ASSERT_FALSE(doc.ok()) << "accepted a case expecting: " << c.expect;
    EXPECT_EQ(doc.status().code(), absl::StatusCode::kInvalidArgument) << doc.status();
    EXPECT_NE(std::string(doc.status().message()).find(c.expect), std::string::npos)
        << doc.status() << " (wanted '" << c.expect << "')";
  }
}

TEST(PickleTest, LimitsBoundResources) {
  PickleLimits lim;
  lim.max_values = 100;
  std::string many = "\x80\x02(";
  for (int k = 0; k < 200; ++k) {
    many += "K\x01";
  }
  many += "t.";
  auto doc = ParsePickle(many, lim);
  ASSERT_FALSE(doc.ok());
  EXPECT_EQ(doc.status().code(), absl::StatusCode::kResourceExhausted);
  lim = PickleLimits{};
  lim.max_marks = 10;
  doc = ParsePickle(std::string("\x80\x02") + std::string(50, '('), lim);
  EXPECT_EQ(doc.status().code(), absl::StatusCode::kResourceExhausted);
  lim = PickleLimits{};
  lim.max_input = 4;
  doc = ParsePickle("\x80\x02N.N", lim);
  EXPECT_EQ(doc.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(PickleTest, NoneTrueFalseAreSharedNotOneValueEach) {
  // 300k None/True/False in a list: four values in all, so a pickle of nothing but N0 costs a
  // stack slot per byte, not a value.
  PickleLimits lim;
  lim.max_values = 10;
  std::string data = "\x80\x02(";
  for (int k = 0; k < 100'000; ++k) {
    data += "N\x88\x89";
  }
  data += "l.";
  auto doc = ParsePickle(data, lim);
  ASSERT_TRUE(doc.ok()) << doc.status();
  const PyValue* list = doc->root();
  ASSERT_EQ(list->items.size(), 300'000u);
  EXPECT_TRUE(list->items[0]->IsNone());
  EXPECT_EQ(list->items[0], list->items[3]);
  EXPECT_TRUE(list->items[1]->b);
  EXPECT_FALSE(list->items[2]->b);
  EXPECT_EQ(list->items[2], list->items[299'999]);
}

TEST(PickleTest, SelfReferenceDoesNotHang) {
  // l = []; l.append(l): a cycle through the memo.
  std::string data =
      "\x80\x02]q\x00h\x00"
      "a."s;
  auto doc = ParsePickle(data);
  ASSERT_TRUE(doc.ok()) << doc.status();
  EXPECT_EQ(doc->root()->items[0], doc->root());
  EXPECT_FALSE(DescribeValue(doc->root(), 6).empty());
}

TEST(PickleTest, RandomCorruptionNeverCrashes) {
  // Cheap in-process fuzzing for compilers without libFuzzer: flip, cut and splice bytes of
  // valid pickles; every result must be a value or a clean error.
  std::mt19937 rng(1234);
  const std::string seeds[] = {FromHex(kProto4), FromHex(kProto5), FromHex(kProto2)};
  int ok = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string d = seeds[iter % 3];
    int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      size_t pos = rng() % d.size();
      switch (rng() % 3) {
        case 0:
          d[pos] = static_cast<char>(rng());
          break;
        case 1:
          d.resize(pos);
          break;
        default:
          d.insert(pos, 1, static_cast<char>(rng()));
      }
      if (d.empty()) {
        d = "x";
      }
    }
    auto doc = ParsePickle(d);
    if (doc.ok()) {
      ++ok;
      (void)DescribeValue(doc->root(), 8);
    }
  }
  EXPECT_LT(ok, 20000);
}

}  // namespace
}  // namespace bragg::reshard
