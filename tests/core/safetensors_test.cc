#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/safetensors_corpus.h"
#include "tests/testing/temp_dir.h"

namespace refit::core {
namespace {

using ::refit::testing::MalformedSafetensorsCorpus;
using ::refit::testing::SafetensorsImage;
using ::refit::testing::SafetensorsImageWithLength;
using ::refit::testing::WriteFileBytes;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A fresh directory per test, so tests never see each other's files.
std::string MakeTempDir() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string dir = ::testing::TempDir() + "safetensors_test." + std::to_string(::getpid()) +
                          "/" + info->test_suite_name() + "." + info->name();
  refit::testing::RemoveTree(dir);
  EXPECT_TRUE(refit::testing::MakeDirs(dir)) << dir;
  return dir;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Span<const uint8_t> BytesOf(const at::Tensor& t) {
  return {static_cast<const uint8_t*>(t.data_ptr()), static_cast<size_t>(t.nbytes())};
}

std::string StringOf(const SafetensorsFile& file, const TensorEntry& e) {
  absl::StatusOr<std::string> bytes = file.ReadAll(e);
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return bytes.ok() ? *bytes : std::string();
}

std::string StringOf(const at::Tensor& t) {
  return std::string(static_cast<const char*>(t.data_ptr()), t.nbytes());
}

TEST(SafetensorsFileTest, RoundTripsDtypesShapesAndMetadata) {
  const std::string path = MakeTempDir() + "/model.safetensors";
  at::Tensor f32 = at::randn({2, 3}, at::kFloat);
  at::Tensor bf16 = at::randn({5}, at::kFloat).to(at::kBFloat16);
  at::Tensor scalar = at::scalar_tensor(-7, at::kLong);
  at::Tensor fp8 = at::randn({3, 1}, at::kFloat).to(at::kFloat8_e4m3fn);
  const uint8_t bools[] = {1, 0};
  std::vector<TensorToWrite> tensors = {
      {"layers.0.w", DType::kFloat32, {2, 3}, BytesOf(f32)},
      {"b", DType::kBFloat16, {5}, BytesOf(bf16)},
      {"empty", DType::kUInt8, {0, 5}, {}},
      {"step", DType::kInt64, {}, BytesOf(scalar)},
      {"q", DType::kFloat8E4M3, {3, 1}, BytesOf(fp8)},
      {"mask", DType::kBool, {2}, absl::MakeConstSpan(bools)},
  };
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"format", "pt"}, {"step", "12"}}).ok());

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->path(), path);
  EXPECT_THAT((*file)->metadata(),
              ElementsAre(std::pair<const std::string, std::string>("format", "pt"),
                          std::pair<const std::string, std::string>("step", "12")));
  // The writer lays tensors out in the given order, and tensors() is in
  // data-offset order, so the two orders agree.
  ASSERT_EQ((*file)->tensors().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorEntry& e = (*file)->tensors()[i];
    SCOPED_TRACE(tensors[i].name);
    EXPECT_EQ(e.name, tensors[i].name);
    EXPECT_EQ(e.dtype, tensors[i].dtype);
    EXPECT_EQ(e.shape, tensors[i].shape);
    EXPECT_EQ(e.nbytes, tensors[i].data.size());
    EXPECT_EQ(StringOf(**file, e),
              std::string(reinterpret_cast<const char*>(tensors[i].data.data()), e.nbytes));
    EXPECT_EQ((*file)->Find(tensors[i].name), &e);
  }
  EXPECT_EQ((*file)->Find("step")->nbytes, 8u);
  EXPECT_TRUE((*file)->Find("step")->shape.empty());
  EXPECT_EQ((*file)->Find("empty")->nbytes, 0u);
  EXPECT_EQ((*file)->Find("missing"), nullptr);

  // Header padded with spaces so the data section starts 8-byte aligned.
  const std::string raw = ReadFile(path);
  uint64_t header_len = 0;
  std::memcpy(&header_len, raw.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(raw.size(),
            8 + header_len + (*file)->tensors().back().offset + (*file)->tensors().back().nbytes);
  EXPECT_EQ((*file)->Find("layers.0.w")->offset, 0u);
  EXPECT_EQ(raw.substr(8 + header_len, f32.nbytes()), StringOf(f32));
}

TEST(SafetensorsFileTest, WriterLeavesNoTemporaryFiles) {
  const std::string dir = MakeTempDir();
  const float x[] = {1, 2};
  std::vector<TensorToWrite> tensors = {
      {"x", DType::kFloat32, {2}, {reinterpret_cast<const uint8_t*>(x), sizeof(x)}}};
  ASSERT_TRUE(WriteSafetensors(dir + "/a.safetensors", tensors).ok());
  // Overwriting replaces the file whole.
  ASSERT_TRUE(WriteSafetensors(dir + "/a.safetensors", tensors).ok());
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  EXPECT_THAT(names, ElementsAre("a.safetensors"));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(dir + "/a.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->metadata().empty());
}

TEST(SafetensorsFileTest, TensorsAreInOffsetOrderWhateverTheHeaderOrder) {
  const std::string data = "AAAAAAAABBBBBBBB";
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::FromBytes(
      SafetensorsImage(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},)"
                       R"("b":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},)"
                       R"("c":{"dtype":"F16","shape":[0],"data_offsets":[16,16]}})",
                       data),
      "mem");
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ((*file)->tensors().size(), 3u);
  EXPECT_EQ((*file)->tensors()[0].name, "b");
  EXPECT_EQ((*file)->tensors()[1].name, "a");
  EXPECT_EQ((*file)->tensors()[2].name, "c");
  EXPECT_EQ(StringOf(**file, *(*file)->Find("a")), "BBBBBBBB");
  EXPECT_EQ(StringOf(**file, *(*file)->Find("b")), "AAAAAAAA");
}

TEST(SafetensorsFileTest, AcceptsGapsTrailingBytesAndHeaderPadding) {
  // Other writers align tensors and pad; only overlap is an error.
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::FromBytes(
      SafetensorsImage("{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,6]}}   ",
                       std::string(10, 'z')),
      "mem");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->Find("a")->offset, 4u);
}

TEST(SafetensorsFileTest, FindsAmongManyTensors) {
  std::vector<std::string> names;
  std::vector<TensorToWrite> tensors;
  const float value = 3.0f;
  for (int i = 0; i < 300; ++i) names.push_back("model.layers." + std::to_string(i) + ".w");
  for (const std::string& name : names) {
    tensors.push_back({name, DType::kFloat32, {1}, {reinterpret_cast<const uint8_t*>(&value), 4}});
  }
  const std::string path = MakeTempDir() + "/many.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  for (size_t i = 0; i < names.size(); ++i) {
    const TensorEntry* e = (*file)->Find(names[i]);
    ASSERT_NE(e, nullptr) << names[i];
    EXPECT_EQ(e->offset, 4 * i);
  }
  EXPECT_EQ((*file)->Find("model.layers.300.w"), nullptr);
}

TEST(SafetensorsFileTest, MissingFileIsNotFound) {
  const std::string path = MakeTempDir() + "/absent.safetensors";
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr(path));
}

TEST(SafetensorsFileTest, UnreadableFileIsPermissionDenied) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads files regardless of mode";
  const std::string path = MakeTempDir() + "/secret.safetensors";
  ASSERT_TRUE(WriteFileBytes(path, SafetensorsImage("{}", "")));
  ASSERT_EQ(::chmod(path.c_str(), 0), 0);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(file.status().message(), HasSubstr(path));
}

TEST(SafetensorsFileTest, DirectoryIsInvalidArgument) {
  const std::string dir = MakeTempDir();
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(dir);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(file.status().message(), HasSubstr("not a regular file"));
}

TEST(SafetensorsFileTest, PathThroughAFileIsNotFound) {
  const std::string file = MakeTempDir() + "/plain";
  ASSERT_TRUE(WriteFileBytes(file, "x"));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> opened =
      SafetensorsFile::Open(file + "/m.safetensors");
  EXPECT_EQ(opened.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(opened.status().message(), HasSubstr(file + "/m.safetensors: cannot open"));
}

TEST(SafetensorsFileTest, EmptyHeaderAndEmptyFileOfTensorsAreValid) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::FromBytes(SafetensorsImage("{}", ""), "mem");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->tensors().empty());
}

TEST(SafetensorsFileTest, RejectsEveryMalformedHeaderInTheCorpus) {
  const std::string dir = MakeTempDir();
  for (const auto& c : MalformedSafetensorsCorpus()) {
    SCOPED_TRACE(c.name);
    const std::string path = dir + "/" + c.name + ".safetensors";
    ASSERT_TRUE(WriteFileBytes(path, c.bytes));
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
    EXPECT_THAT(file.status().message(), HasSubstr(path + ": "));
    EXPECT_THAT(file.status().message(), HasSubstr(c.message_fragment));

    // FromBytes shares the validation and uses the label for the path.
    file = SafetensorsFile::FromBytes(c.bytes, "label.safetensors");
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(file.status().message(), HasSubstr("label.safetensors: "));
    EXPECT_THAT(file.status().message(), HasSubstr(c.message_fragment));
  }
}

TEST(SafetensorsFileTest, SurvivesRandomHeaderMutations) {
  const float values[] = {1, 2, 3, 4, 5, 6};
  const std::string path = MakeTempDir() + "/valid.safetensors";
  std::vector<TensorToWrite> tensors = {
      {"a", DType::kFloat32, {2, 2}, {reinterpret_cast<const uint8_t*>(values), 16}},
      {"b", DType::kFloat16, {4}, {reinterpret_cast<const uint8_t*>(values + 4), 8}},
      {"e", DType::kInt8, {0}, {}}};
  ASSERT_TRUE(WriteSafetensors(path, tensors, {{"k", "v"}}).ok());
  const std::string valid = ReadFile(path);
  uint64_t header_len = 0;
  std::memcpy(&header_len, valid.data(), 8);
  const size_t mutable_bytes = 8 + header_len;

  std::mt19937 rng(20261129);
  std::uniform_int_distribution<size_t> position(0, mutable_bytes - 1);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_int_distribution<int> flips(1, 4);
  int accepted = 0;
  for (int iteration = 0; iteration < 500; ++iteration) {
    std::string image = valid;
    for (int n = flips(rng); n > 0; --n) {
      image[position(rng)] = static_cast<char>(byte(rng));
    }
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
        SafetensorsFile::FromBytes(image, "fuzz");
    if (!file.ok()) {
      ASSERT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument)
          << "iteration " << iteration << ": " << file.status();
      continue;
    }
    ++accepted;
    // Whatever was accepted must stay inside the image it came from.
    uint64_t len = 0;
    std::memcpy(&len, image.data(), 8);
    const uint64_t data_size = image.size() - 8 - len;
    for (const TensorEntry& e : (*file)->tensors()) {
      ASSERT_LE(e.offset + e.nbytes, data_size) << "iteration " << iteration;
    }
  }
  // Some mutations (inside string values, whitespace) keep the file valid.
  EXPECT_GT(accepted, 0);
}

TEST(SafetensorsFileTest, TruncatedWhileOpenIsFailedPreconditionNotSigbus) {
  const std::string path = MakeTempDir() + "/shrinks.safetensors";
  std::vector<uint8_t> a(1 << 16, 0x11);
  std::vector<uint8_t> b(1 << 16, 0x22);
  ASSERT_TRUE(WriteSafetensors(path, {{"a", DType::kUInt8, {1 << 16}, absl::MakeConstSpan(a)},
                                      {"b", DType::kUInt8, {1 << 16}, absl::MakeConstSpan(b)}})
                  .ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(StringOf(**file, *(*file)->Find("a")), std::string(a.begin(), a.end()));
  // What a trainer rewriting the checkpoint in place does to a reader.
  ASSERT_EQ(::truncate(path.c_str(), 100), 0);
  absl::StatusOr<std::string> read = (*file)->ReadAll(*(*file)->Find("b"));
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr(path));
  EXPECT_THAT(read.status().message(), HasSubstr("tensor \"b\""));
  EXPECT_THAT(read.status().message(), HasSubstr("changed while being read"));
}

TEST(SafetensorsFileTest, RewrittenInPlaceIsFailedPrecondition) {
  const std::string path = MakeTempDir() + "/rewritten.safetensors";
  std::vector<uint8_t> a(64, 0x11);
  ASSERT_TRUE(WriteSafetensors(path, {{"a", DType::kUInt8, {64}, absl::MakeConstSpan(a)}}).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  // Same size, new bytes, a later modification time.
  std::string raw = ReadFile(path);
  raw.back() = '\x7f';
  ASSERT_TRUE(WriteFileBytes(path, raw));
  struct timespec times[2] = {{0, UTIME_OMIT}, {0, UTIME_NOW}};
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  times[1] = {st.st_mtim.tv_sec + 1, st.st_mtim.tv_nsec};  // coarse clocks
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  absl::StatusOr<std::string> read = (*file)->ReadAll(*(*file)->Find("a"));
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr("modified since it was opened"));
}

TEST(SafetensorsFileTest, ReadOutsideTheTensorIsInvalidArgument) {
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::FromBytes(
      SafetensorsImage(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", "abcdefgh"),
      "mem");
  ASSERT_TRUE(file.ok()) << file.status();
  uint8_t out[4];
  absl::Status s = (*file)->Read(*(*file)->Find("a"), 2, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("not inside"));
  ASSERT_TRUE((*file)->Read(*(*file)->Find("a"), 1, absl::MakeSpan(out, 3)).ok());
  EXPECT_EQ(std::string(reinterpret_cast<char*>(out), 3), "bcd");
}

TEST(SafetensorsFileTest, RejectsANulByteInTheHeader) {
  // Before the check, the JSON parser stopped at the NUL and accepted the
  // file with "b" silently dropped.
  const std::string header =
      std::string(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]})") +
      std::string(1, '\0') + R"(,"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})";
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::FromBytes(SafetensorsImage(header, "abcdefgh"), "nul.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  EXPECT_THAT(file.status().message(),
              HasSubstr("nul.safetensors: header has a NUL byte at offset 52"));
  // Trailing spaces stay allowed padding.
  file = SafetensorsFile::FromBytes(
      SafetensorsImage(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}     )", "abcd"),
      "padded");
  EXPECT_TRUE(file.ok()) << file.status();
}

TEST(SafetensorsFileTest, RejectsMoreEntriesThanTheLimit) {
  std::string header = "{";
  for (size_t i = 0; i <= kMaxSafetensorsHeaderEntries; ++i) {
    absl::StrAppend(&header, i == 0 ? "" : ",", "\"t", i,
                    "\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}");
  }
  header += "}";
  ASSERT_LT(header.size(), kMaxSafetensorsHeaderBytes);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::FromBytes(SafetensorsImage(header, ""), "many.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  EXPECT_THAT(file.status().message(),
              HasSubstr(absl::StrCat("header has more than ", kMaxSafetensorsHeaderEntries,
                                     " entries, the limit per file")));
}

TEST(SafetensorsFileTest, RejectsAHeaderLongerThanTheLimit) {
  const std::string image = SafetensorsImageWithLength(kMaxSafetensorsHeaderBytes + 1, "{}");
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::FromBytes(image, "big.safetensors");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  EXPECT_THAT(file.status().message(),
              HasSubstr(absl::StrCat("exceeds the limit of ", kMaxSafetensorsHeaderBytes)));
}

TEST(WriteSafetensorsTest, RejectsDataSizeMismatch) {
  const std::string path = MakeTempDir() + "/bad.safetensors";
  const uint8_t bytes[10] = {};
  std::vector<TensorToWrite> tensors = {
      {"x.weight", DType::kBFloat16, {2, 3}, absl::MakeConstSpan(bytes)}};
  absl::Status status = WriteSafetensors(path, tensors);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(),
              HasSubstr("tensor \"x.weight\": shape [2, 3] of BF16 needs 12 bytes but 10"));
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(WriteSafetensorsTest, RejectsDuplicateAndReservedNames) {
  const std::string path = MakeTempDir() + "/bad.safetensors";
  const uint8_t bytes[4] = {};
  std::vector<TensorToWrite> duplicate = {{"x", DType::kUInt8, {4}, absl::MakeConstSpan(bytes)},
                                          {"x", DType::kUInt8, {4}, absl::MakeConstSpan(bytes)}};
  absl::Status status = WriteSafetensors(path, duplicate);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("tensor \"x\" is given twice"));

  std::vector<TensorToWrite> reserved = {
      {"__metadata__", DType::kUInt8, {4}, absl::MakeConstSpan(bytes)}};
  status = WriteSafetensors(path, reserved);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("\"__metadata__\" is reserved"));

  std::vector<TensorToWrite> negative = {{"n", DType::kUInt8, {-4}, {}}};
  status = WriteSafetensors(path, negative);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("tensor \"n\": invalid shape [-4]"));
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(WriteSafetensorsTest, RejectsOverflowingShapes) {
  const std::string path = MakeTempDir() + "/bad.safetensors";
  std::vector<TensorToWrite> tensors = {
      {"huge", DType::kUInt8, {int64_t{1} << 32, int64_t{1} << 32, 16}, {}}};
  absl::Status status = WriteSafetensors(path, tensors);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("tensor \"huge\": invalid shape [4294967296"));
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(WriteSafetensorsTest, RejectsNamesThatAreNotUtf8) {
  // JSON headers hold UTF-8 only; a stray Latin-1 byte must not produce a
  // file that no reader accepts.
  const std::string path = MakeTempDir() + "/bad.safetensors";
  std::vector<TensorToWrite> tensors = {{"caf\xe9", DType::kUInt8, {0}, {}}};
  absl::Status status = WriteSafetensors(path, tensors);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("header cannot be encoded as JSON"));
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(WriteSafetensorsTest, MissingDirectoryIsInternal) {
  const std::string path = MakeTempDir() + "/no/such/dir/x.safetensors";
  absl::Status status = WriteSafetensors(path, {});
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(status.message(), HasSubstr("cannot create"));
}

TEST(ListSafetensorsFilesTest, ListsSortedShardsOnly) {
  const std::string dir = MakeTempDir();
  for (const char* name : {"model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors",
                           "config.json", "model.safetensors.index.json", "x.safetensors.tmp.1"}) {
    ASSERT_TRUE(WriteFileBytes(dir + "/" + name, "{}"));
  }
  std::filesystem::create_directory(dir + "/sub.safetensors");
  std::filesystem::create_symlink(dir + "/model-00001-of-00002.safetensors",
                                  dir + "/linked.safetensors");
  absl::StatusOr<std::vector<std::string>> files = ListSafetensorsFiles(dir);
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(*files,
              ElementsAre(dir + "/linked.safetensors", dir + "/model-00001-of-00002.safetensors",
                          dir + "/model-00002-of-00002.safetensors"));
}

TEST(ListSafetensorsFilesTest, EmptyOrMissingDirectoryIsNotFound) {
  const std::string dir = MakeTempDir();
  ASSERT_TRUE(WriteFileBytes(dir + "/config.json", "{}"));
  absl::StatusOr<std::vector<std::string>> files = ListSafetensorsFiles(dir);
  EXPECT_EQ(files.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(files.status().message(), HasSubstr("no *.safetensors files"));

  files = ListSafetensorsFiles(dir + "/missing");
  EXPECT_EQ(files.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(files.status().message(), HasSubstr(dir + "/missing"));
}

TEST(ListSafetensorsFilesTest, AFileInsteadOfADirectoryIsNotFound) {
  const std::string file = MakeTempDir() + "/model.safetensors";
  ASSERT_TRUE(WriteFileBytes(file, SafetensorsImage("{}", "")));
  absl::StatusOr<std::vector<std::string>> files = ListSafetensorsFiles(file);
  EXPECT_EQ(files.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(files.status().message(), HasSubstr(file + ": cannot list directory"));
}

TEST(ListSafetensorsFilesTest, UnreadableDirectoryIsPermissionDenied) {
  if (::geteuid() == 0) GTEST_SKIP() << "root lists directories regardless of mode";
  const std::string dir = MakeTempDir() + "/locked";
  ASSERT_EQ(::mkdir(dir.c_str(), 0), 0);
  absl::StatusOr<std::vector<std::string>> files = ListSafetensorsFiles(dir);
  EXPECT_EQ(files.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(files.status().message(), HasSubstr(dir + ": cannot list directory"));
  ::chmod(dir.c_str(), 0755);
}

// The Python safetensors package is the reference implementation: it must
// read what we write, and we must read what it writes, byte for byte.
TEST(SafetensorsInteropTest, MatchesPythonSafetensors) {
  // Tests run from the repository root, where scripts/setup.sh creates .venv.
  const char* env_python = std::getenv("REFIT_PYTHON");
  const std::string python = env_python != nullptr ? env_python : ".venv/bin/python";
  if (::access(python.c_str(), X_OK) != 0) GTEST_SKIP() << python << " not available";
  const std::string dir = MakeTempDir();
  const std::string ours = dir + "/ours.safetensors";
  const std::string theirs = dir + "/theirs.safetensors";

  at::Tensor w = at::arange(6, at::kFloat).reshape({2, 3}) * 0.5;
  at::Tensor h = at::arange(4, at::kFloat).to(at::kBFloat16);
  at::Tensor i = at::scalar_tensor(42, at::kInt);
  std::vector<TensorToWrite> tensors = {{"w", DType::kFloat32, {2, 3}, BytesOf(w)},
                                        {"h", DType::kBFloat16, {4}, BytesOf(h)},
                                        {"i", DType::kInt32, {}, BytesOf(i)},
                                        {"e", DType::kFloat16, {0, 3}, {}}};
  ASSERT_TRUE(WriteSafetensors(ours, tensors, {{"format", "pt"}}).ok());

  const std::string script = dir + "/check.py";
  ASSERT_TRUE(WriteFileBytes(script, R"PY(
import sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ours, theirs = sys.argv[1], sys.argv[2]
t = load_file(ours)
assert torch.equal(t["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3) * 0.5), t["w"]
assert t["h"].dtype == torch.bfloat16 and torch.equal(t["h"], torch.arange(4).to(torch.bfloat16))
assert t["i"].shape == () and t["i"].item() == 42 and t["i"].dtype == torch.int32
assert t["e"].shape == (0, 3) and t["e"].dtype == torch.float16
with safe_open(ours, "pt") as f:
    assert f.metadata() == {"format": "pt"}, f.metadata()
save_file({"a": torch.arange(12, dtype=torch.int64).reshape(3, 4),
           "b": (torch.arange(5, dtype=torch.float32) / 4).to(torch.float16),
           "s": torch.tensor(2.5, dtype=torch.float64)},
          theirs, metadata={"source": "python"})
)PY"));
  const std::string command = python + " " + script + " " + ours + " " + theirs;
  ASSERT_EQ(std::system(command.c_str()), 0) << command;

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(theirs);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().at("source"), "python");
  const TensorEntry* a = (*file)->Find("a");
  const TensorEntry* b = (*file)->Find("b");
  const TensorEntry* s = (*file)->Find("s");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(a->dtype, DType::kInt64);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(StringOf(**file, *a), StringOf(at::arange(12, at::kLong).reshape({3, 4})));
  EXPECT_EQ(b->dtype, DType::kFloat16);
  EXPECT_EQ(StringOf(**file, *b), StringOf((at::arange(5, at::kFloat) / 4).to(at::kHalf)));
  EXPECT_EQ(s->dtype, DType::kFloat64);
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ(StringOf(**file, *s), StringOf(at::scalar_tensor(2.5, at::kDouble)));
}

}  // namespace
}  // namespace refit::core
