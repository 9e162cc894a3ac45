#include "reshard/zip.h"

#include <fcntl.h>
#include <gtest/gtest.h>

#include <random>

#include "common/fs.h"
#include "reshard/dist_checkpoint.h"
#include "reshard/test_util.h"
#include "reshard/torch_file.h"

namespace bragg::reshard {
namespace {

using testing::FromHex;
using testing::MakeZip;

// torch.save(torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), buf) from Debian's torch 1.13.
constexpr std::string_view kTorchSave =
    "504b03040000080800000000000000000000000000000000000010001200617263686976652f646174612e706b6c46"
    "42"
    "0e005a5a5a5a5a5a5a5a5a5a5a5a5a5a800263746f7263682e5f7574696c730a5f72656275696c645f74656e736f72"
    "5f"
    "76320a71002828580700000073746f72616765710163746f7263680a42466c6f6174313653746f726167650a710258"
    "01"
    "000000307103580300000063707571044b06747105514b004b024b038671064b034b018671078963636f6c6c656374"
    "69"
    "6f6e730a4f726465726564446963740a71082952710974710a52710b2e504b0708fd14a8169d0000009d000000504b"
    "03"
    "04000008080000000000000000000000000000000000000e002700617263686976652f646174612f30464223005a5a"
    "5a"
    "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a0000803f004040408040a040504b07"
    "08"
    "b321e03a0c0000000c000000504b0304000008080000000000000000000000000000000000000f0037006172636869"
    "76"
    "652f76657273696f6e464233005a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a"
    "5a"
    "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a330a504b0708d19e67550200000002000000504b0102000000000808000000"
    "00"
    "0000fd14a8169d0000009d000000100000000000000000000000000000000000617263686976652f646174612e706b"
    "6c"
    "504b0102000000000808000000000000b321e03a0c0000000c0000000e00000000000000000000000000ed00000061"
    "72"
    "63686976652f646174612f30504b0102000000000808000000000000d19e675502000000020000000f000000000000"
    "00"
    "0000000000005c010000617263686976652f76657273696f6e504b06062c000000000000001e032d00000000000000"
    "00"
    "0003000000000000000300000000000000b700000000000000d201000000000000504b060700000000890200000000"
    "00"
    "0001000000504b05060000000003000300b7000000d20100000000";

TEST(ZipTest, ReadsTorchSaveArchive) {
  std::string z = FromHex(kTorchSave);
  auto entries = ReadZipDirectoryFromMemory(z);
  ASSERT_TRUE(entries.ok()) << entries.status();
  ASSERT_EQ(entries->size(), 3u);
  EXPECT_EQ((*entries)[0].name, "archive/data.pkl");
  EXPECT_EQ((*entries)[1].name, "archive/data/0");
  EXPECT_EQ((*entries)[1].size, 12u);
  // torch.save aligns tensor data to 64 bytes.
  EXPECT_EQ((*entries)[1].data_offset % 64, 0u);
}

TEST(ZipTest, TorchArchiveAtAnOffsetInAFile) {
  auto dir = TempDir::Create();
  ASSERT_TRUE(dir.ok());
  std::string z = FromHex(kTorchSave);
  std::string file = std::string(1000, 'x') + z + std::string(77, 'y');
  std::string path = dir->path() + "/f.distcp";
  ASSERT_TRUE(WriteStringToFile(path, file).ok());
  auto fd = OpenFile(path, O_RDONLY);
  ASSERT_TRUE(fd.ok());
  auto a = TorchArchive::Open(fd->get(), 1000, z.size());
  ASSERT_TRUE(a.ok()) << a.status();
  auto t = a->Tensor(a->root());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype, DType::kBF16);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t->bytes, 12u);
  // bf16 of 0..5: 0x0000 0x3f80 0x4000 0x4040 0x4080 0x40a0.
  ASSERT_GE(file.size(), t->data_offset + 12);
  EXPECT_EQ(file.substr(t->data_offset, 4), std::string("\x00\x00\x80\x3f", 4));
  EXPECT_EQ(static_cast<uint8_t>(file[t->data_offset + 11]), 0x40);
  // Truncated region: the EOCD is no longer at the end.
  EXPECT_FALSE(TorchArchive::Open(fd->get(), 1000, z.size() - 1).ok());
  // Region past the end of the file.
  EXPECT_FALSE(TorchArchive::Open(fd->get(), 1000 + 77, z.size() + 100).ok());
}

TEST(ZipTest, ChunkArchivePickleIsBoundedTightly) {
  // A chunk's data.pkl holds one tensor (a few hundred bytes): 2 MiB is refused before it is
  // read, and 200k values in a small one are refused while parsing.
  auto dir = TempDir::Create();
  ASSERT_TRUE(dir.ok());
  std::string big = "\x80\x02" + std::string(2 << 20, 'N') + ".";
  std::string many = "\x80\x02(";
  for (int k = 0; k < 200'000; ++k) {
    many += "K\x01";
  }
  many += "l.";
  ASSERT_LT(many.size(), 1u << 20);
  for (const std::string& pkl : {big, many}) {
    const std::string path = dir->path() + "/c.distcp";
    ASSERT_TRUE(WriteStringToFile(path, MakeZip({{"a/data.pkl", pkl}})).ok());
    auto fd = OpenFile(path, O_RDONLY);
    ASSERT_TRUE(fd.ok());
    auto a = TorchArchive::Open(fd->get(), 0, MakeZip({{"a/data.pkl", pkl}}).size(),
                                TorchArchive::ChunkLimits());
    EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted) << a.status();
  }
}

// A protocol-2 data.pkl of one bf16 tensor: _rebuild_tensor_v2(persistent ('storage',
// BFloat16Storage, '0', 'cpu', 6), 0, size, stride, False), size and stride as given.
std::string TensorPickle(const std::vector<int64_t>& size, const std::vector<int64_t>& stride) {
  auto str = [](std::string_view v) {
    std::string out = "X";
    testing::PutLe(&out, v.size(), 4);
    return out + std::string(v);
  };
  auto ints = [](const std::vector<int64_t>& v) {
    std::string out = "(";
    for (int64_t x : v) {
      out += "\x8a\x08";  // LONG1 of 8 bytes, two's complement
      testing::PutLe(&out, static_cast<uint64_t>(x), 8);
    }
    return out + "t";
  };
  return std::string("\x80\x02") + "ctorch._utils\n_rebuild_tensor_v2\n((" + str("storage") +
         "ctorch\nBFloat16Storage\n" + str("0") + str("cpu") + std::string("K\x06tQK\x00", 6) +
         ints(size) + ints(stride) + "\x89tR.";
}

TEST(ZipTest, HostileTensorShapesAreRefusedNotWrapped) {
  auto dir = TempDir::Create();
  ASSERT_TRUE(dir.ok());
  const std::string path = dir->path() + "/t.pt";
  auto open = [&](const std::vector<int64_t>& size, const std::vector<int64_t>& stride) {
    std::string z = MakeZip({{"a/data.pkl", TensorPickle(size, stride)}, {"a/data/0", "012345"}});
    EXPECT_TRUE(WriteStringToFile(path, z).ok());
    auto fd = OpenFile(path, O_RDONLY);
    EXPECT_TRUE(fd.ok());
    auto a = TorchArchive::Open(fd->get(), 0, z.size());
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->Tensor(a->root()) : Result<TensorRef>(a.status());
  };
  // The pickle itself is sound: 3 elements fit the 6-byte storage.
  auto ok = open({3}, {1});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->bytes, 6u);
  // 2^40 x 2^24 elements (strides consistent) is 2^64: it used to wrap to 0 bytes and pass.
  auto t = open({int64_t{1} << 40, int64_t{1} << 24}, {int64_t{1} << 24, 1});
  EXPECT_TRUE(absl::IsInvalidArgument(t.status())) << t.status();
  EXPECT_NE(std::string(t.status().message()).find("more than"), std::string::npos) << t.status();
  t = open({int64_t{1} << 30, int64_t{1} << 30}, {int64_t{1} << 30, 1});  // 2^60
  EXPECT_TRUE(absl::IsInvalidArgument(t.status())) << t.status();
  t = open({2, 3}, {-3, 1});  // a negative stride
  EXPECT_TRUE(absl::IsInvalidArgument(t.status())) << t.status();
}

TEST(MetadataTest, HugeOrAmplifyingMetadataIsRefusedCheaply) {
  auto dir = TempDir::Create();
  ASSERT_TRUE(dir.ok());
  const std::string path = dir->path() + "/.metadata";
  // A sparse file past the limit: refused by its size, before a byte is read.
  {
    auto fd = OpenFile(path, O_WRONLY | O_CREAT | O_TRUNC);
    ASSERT_TRUE(fd.ok());
    ASSERT_EQ(::ftruncate(fd->get(), static_cast<off_t>(kMaxMetadataBytes + 1)), 0);
  }
  auto idx = ReadDistCheckpointIndex(dir->path());
  EXPECT_EQ(idx.status().code(), absl::StatusCode::kResourceExhausted) << idx.status();
  EXPECT_NE(std::string(idx.status().message()).find("more than the limit"), std::string::npos);
  // 4 MB of None: a stack slot each (shared value), refused at the stack limit of 1M.
  ASSERT_TRUE(WriteStringToFile(path, "\x80\x02" + std::string(4'000'000, 'N') + ".").ok());
  idx = ReadDistCheckpointIndex(dir->path());
  EXPECT_EQ(idx.status().code(), absl::StatusCode::kResourceExhausted) << idx.status();
  EXPECT_NE(std::string(idx.status().message()).find(".metadata"), std::string::npos);
  // The value limit follows the file's size.
  EXPECT_EQ(MetadataLimits(1000).max_values, 5096u);
  EXPECT_EQ(MetadataLimits(1ull << 30).max_values, 50'000'000u);
}

TEST(ZipTest, Zip64Directory) {
  std::string z = MakeZip({{"a/data.pkl", "xyz"}, {"a/data/0", std::string(100, '\7')}}, true);
  auto entries = ReadZipDirectoryFromMemory(z);
  ASSERT_TRUE(entries.ok()) << entries.status();
  ASSERT_EQ(entries->size(), 2u);
  EXPECT_EQ((*entries)[1].size, 100u);
  EXPECT_EQ(z.substr((*entries)[1].data_offset, 100), std::string(100, '\7'));
  EXPECT_EQ(z.substr((*entries)[0].data_offset, 3), "xyz");
}

TEST(ZipTest, RejectsHostileArchives) {
  std::string good = MakeZip({{"a", "hello"}});
  ASSERT_TRUE(ReadZipDirectoryFromMemory(good).ok());
  EXPECT_FALSE(ReadZipDirectoryFromMemory("").ok());
  EXPECT_FALSE(ReadZipDirectoryFromMemory(std::string(100, '\0')).ok());
  // Compressed entry (method 8).
  std::string deflated = good;
  deflated[8] = 8;
  size_t cd = good.find("PK\x01\x02");
  deflated[cd + 10] = 8;
  auto r = ReadZipDirectoryFromMemory(deflated);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented) << r.status();
  // Entry size pointing past the directory.
  std::string big = good;
  big[cd + 20] = big[cd + 24] = '\x7f';
  r = ReadZipDirectoryFromMemory(big);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  // Entry count far beyond what the directory can hold.
  std::string many = good;
  size_t eocd = good.rfind("PK\x05\x06");
  many[eocd + 10] = many[eocd + 8] = '\xff';
  many[eocd + 11] = many[eocd + 9] = '\x7f';
  r = ReadZipDirectoryFromMemory(many);
  EXPECT_FALSE(r.ok());
  // Central directory offset out of range.
  std::string off = good;
  off[eocd + 19] = '\x70';
  EXPECT_FALSE(ReadZipDirectoryFromMemory(off).ok());
  // Zip64 markers without zip64 records.
  std::string z64 = good;
  for (int k = 12; k < 20; ++k) {
    z64[eocd + k] = '\xff';
  }
  r = ReadZipDirectoryFromMemory(z64);
  EXPECT_NE(std::string(r.status().message()).find("zip64"), std::string::npos) << r.status();
  // Local header offset out of range.
  std::string local = good;
  local[cd + 45] = '\x40';
  EXPECT_FALSE(ReadZipDirectoryFromMemory(local).ok());
}

TEST(ZipTest, RandomCorruptionNeverCrashes) {
  std::mt19937 rng(99);
  const std::string seeds[] = {FromHex(kTorchSave), MakeZip({{"a/data.pkl", "N."}}, true)};
  for (int iter = 0; iter < 20000; ++iter) {
    std::string d = seeds[iter % 2];
    int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      size_t pos = rng() % d.size();
      if (rng() % 8 == 0) {
        d.resize(std::max<size_t>(pos, 1));
      } else {
        d[pos] = static_cast<char>(rng());
      }
    }
    auto entries = ReadZipDirectoryFromMemory(d);
    if (entries.ok()) {
      for (const ZipEntry& e : *entries) {
        ASSERT_LE(e.data_offset + e.size, d.size());
      }
    }
  }
}

}  // namespace
}  // namespace bragg::reshard
