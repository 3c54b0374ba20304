// SafetensorsView, the client's reader of the files a trainer pushes: it must
// refuse every file the daemon's own reader refuses (the shared malformed
// corpus), with INVALID_ARGUMENT naming the file, and report files it cannot
// open by the reason.
#include "client/safetensors_view.h"

#include <ftw.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/fixture_model.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/safetensors_corpus.h"

namespace refit::client {
namespace {

using ::refit::testing::MalformedSafetensorsCorpus;
using ::refit::testing::SafetensorsImage;
using ::refit::testing::WriteFileBytes;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// POSIX, not std::filesystem: this directory's tests link LibTorch, whose
// libtorch.so exports broken std::filesystem symbols.
class SafetensorsViewTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/safetensors_view_test_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
  }
  void TearDown() override {
    ::nftw(
        dir_.c_str(),
        [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 8,
        FTW_DEPTH | FTW_PHYS);
  }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string Write(const std::string& name, const std::string& bytes) const {
    EXPECT_TRUE(WriteFileBytes(Path(name), bytes));
    return Path(name);
  }

  std::string dir_;
};

TEST_F(SafetensorsViewTest, OpensTensorsInOffsetOrder) {
  const std::string path = Write(
      "m.safetensors", SafetensorsImage(R"({"__metadata__":{"format":"pt"},)"
                                        R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]},)"
                                        R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                                        R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
                                        "AAAABBBB"));
  absl::StatusOr<std::unique_ptr<SafetensorsView>> view = SafetensorsView::Open(path);
  ASSERT_TRUE(view.ok()) << view.status();
  std::vector<std::string> names;
  for (const SafetensorsTensor& t : (*view)->tensors()) names.push_back(t.name);
  EXPECT_THAT(names, ElementsAre("a", "e", "b"));
  EXPECT_EQ((*view)->tensors()[2].dtype, refit::v1::DTYPE_BF16);
  EXPECT_EQ(*(*view)->ReadAll((*view)->tensors()[2]), "BBBB");
}

TEST_F(SafetensorsViewTest, RejectsEveryMalformedFileOfTheCorpusNamingIt) {
  for (const auto& c : MalformedSafetensorsCorpus()) {
    SCOPED_TRACE(c.name);
    const std::string path = Write(c.name + ".safetensors", c.bytes);
    absl::StatusOr<std::unique_ptr<SafetensorsView>> view = SafetensorsView::Open(path);
    EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument) << view.status();
    EXPECT_THAT(view.status().message(), HasSubstr(path + ": "));
  }
}

TEST_F(SafetensorsViewTest, MalformedFilesNameTheTensorAndTheRule) {
  const std::string data16(16, '\x01');
  struct Case {
    std::string header;
    const char* message;
  };
  const Case cases[] = {
      {R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})",
       "tensor 'w': data_offsets span 4 bytes, shape and dtype need 6"},
      {R"({"w":{"dtype":"U8","shape":[32],"data_offsets":[0,32]}})",
       "tensor 'w': data_offsets [0, 32) outside the data section of 16 bytes"},
      {R"({"w":{"dtype":"F64","shape":[2]}})",
       "tensor 'w': needs dtype, shape and data_offsets [begin, end]"},
      {R"({"w":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})",
       "tensor 'w': dtype F64 cannot be pushed"},
      {R"({"w":{"dtype":"F32","shape":[2,-1],"data_offsets":[0,8]}})",
       "tensor 'w': shape must hold non-negative integers"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,"8"]}})",
       "tensor 'w': data_offsets must be non-negative integers"},
      // 2^32 * 2^32 * 16 wraps to 0 in 64 bits: a zero-byte range must not
      // pass for a shape of 2^68 elements.
      {R"({"w":{"dtype":"U8","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}})",
       "tensor 'w': shape [4294967296,4294967296,16] overflows 64 bits"},
      {R"({"w":{"dtype":"I64","shape":[4611686018427387904],"data_offsets":[0,0]}})",
       "tensor 'w': shape [4611686018427387904] of I64 overflows 64 bits"},
      {R"({"w":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,8]}})",
       "tensor 'w': shape [18446744073709551615] overflows 64 bits"},
      {R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
       R"("a":{"dtype":"U8","shape":[8],"data_offsets":[8,16]}})",
       "header names tensor 'a' twice"},
      {R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       "tensors 'a' and 'b' overlap in data_offsets"},
      {"{\"a\":" + std::string(40, '[') + std::string(40, ']') + "}",
       "header nests deeper than 16 levels"},
      {R"({"__metadata__":{"format":"pt","n":1}})", "__metadata__ must map strings to strings"},
      {"{\"w\": {\"dtype\": ", "header is not valid JSON"},
      {"[1, 2]", "header is not a JSON object"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    const std::string path = Write("bad.safetensors", SafetensorsImage(c.header, data16));
    absl::StatusOr<std::unique_ptr<SafetensorsView>> view = SafetensorsView::Open(path);
    EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument) << view.status();
    EXPECT_THAT(view.status().message(), HasSubstr(path + ": "));
    EXPECT_THAT(view.status().message(), HasSubstr(c.message));
  }
}

TEST_F(SafetensorsViewTest, ShortFilesAndForgedLengthsAreInvalidArgument) {
  const std::string short_file = Write("short.safetensors", "abc");
  absl::StatusOr<std::unique_ptr<SafetensorsView>> view = SafetensorsView::Open(short_file);
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(view.status().message(), HasSubstr("3 bytes is too short for a safetensors file"));

  const std::string forged =
      Write("forged.safetensors", refit::testing::SafetensorsImageWithLength(1000, "{}"));
  view = SafetensorsView::Open(forged);
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(view.status().message(), HasSubstr("header length 1000 exceeds the file size 10"));
}

TEST_F(SafetensorsViewTest, MissingFileIsNotFound) {
  absl::StatusOr<std::unique_ptr<SafetensorsView>> view =
      SafetensorsView::Open(Path("missing.safetensors"));
  EXPECT_EQ(view.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(view.status().message(), HasSubstr(Path("missing.safetensors")));

  // A file where a directory should be: no such file either.
  const std::string file = Write("plain", "x");
  view = SafetensorsView::Open(file + "/m.safetensors");
  EXPECT_EQ(view.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(view.status().message(), HasSubstr(file + "/m.safetensors"));
}

TEST_F(SafetensorsViewTest, UnreadableFileIsPermissionDenied) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads files regardless of mode";
  const std::string path = Write("secret.safetensors", SafetensorsImage("{}", ""));
  ASSERT_EQ(::chmod(path.c_str(), 0), 0);
  absl::StatusOr<std::unique_ptr<SafetensorsView>> view = SafetensorsView::Open(path);
  EXPECT_EQ(view.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(view.status().message(), HasSubstr(path));
}

TEST_F(SafetensorsViewTest, DirectoryIsInvalidArgument) {
  absl::StatusOr<std::unique_ptr<SafetensorsView>> view = SafetensorsView::Open(dir_);
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(view.status().message(), HasSubstr(dir_ + ": not a regular file"));
}

TEST_F(SafetensorsViewTest, ExpandListsRegularShardsOfDirectoriesAndKeepsFiles) {
  Write("model-2.safetensors", "{}");
  Write("model-1.safetensors", "{}");
  Write("config.json", "{}");
  ASSERT_EQ(::mkdir(Path("sub.safetensors").c_str(), 0755), 0);
  ASSERT_EQ(::symlink(Path("model-1.safetensors").c_str(), Path("linked.safetensors").c_str()), 0);
  absl::StatusOr<std::vector<std::string>> files =
      ExpandSafetensorsPaths({dir_, Path("config.json")});
  ASSERT_TRUE(files.ok()) << files.status();
  EXPECT_THAT(*files, ElementsAre(Path("linked.safetensors"), Path("model-1.safetensors"),
                                  Path("model-2.safetensors"), Path("config.json")));
}

TEST_F(SafetensorsViewTest, ExpandWithNothingToPushIsNotFound) {
  absl::StatusOr<std::vector<std::string>> files = ExpandSafetensorsPaths({});
  EXPECT_EQ(files.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(files.status().message(), HasSubstr("no safetensors files given"));

  files = ExpandSafetensorsPaths({Path("nothing-here")});
  EXPECT_EQ(files.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(files.status().message(), HasSubstr("no such file or directory: "));
  EXPECT_THAT(files.status().message(), HasSubstr(Path("nothing-here")));

  Write("config.json", "{}");
  files = ExpandSafetensorsPaths({dir_});
  EXPECT_EQ(files.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(files.status().message(), HasSubstr("no *.safetensors files in " + dir_));
}

TEST_F(SafetensorsViewTest, ExpandOfAnUnreadableDirectoryIsPermissionDenied) {
  if (::geteuid() == 0) GTEST_SKIP() << "root lists directories regardless of mode";
  ASSERT_EQ(::mkdir(Path("locked").c_str(), 0), 0);
  absl::StatusOr<std::vector<std::string>> files = ExpandSafetensorsPaths({Path("locked")});
  EXPECT_EQ(files.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(files.status().message(), HasSubstr(Path("locked")));
  ::chmod(Path("locked").c_str(), 0755);
}

TEST(SafetensorsDTypeTest, NamesAndSizesOfEveryTypeThatCanBePushed) {
  struct Case {
    const char* name;
    refit::v1::DType dtype;
    size_t bytes;
  };
  const Case cases[] = {
      {"F32", refit::v1::DTYPE_F32, 4},   {"F16", refit::v1::DTYPE_F16, 2},
      {"BF16", refit::v1::DTYPE_BF16, 2}, {"F8_E4M3", refit::v1::DTYPE_F8_E4M3, 1},
      {"I64", refit::v1::DTYPE_I64, 8},   {"I32", refit::v1::DTYPE_I32, 4},
      {"U8", refit::v1::DTYPE_U8, 1},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(DTypeFromSafetensorsName(c.name), c.dtype) << c.name;
    EXPECT_EQ(SafetensorsNameOf(c.dtype), c.name);
    EXPECT_EQ(DTypeBytes(c.dtype), c.bytes) << c.name;
  }
}

TEST(SafetensorsDTypeTest, TypesRefitCannotCarryAreUnspecified) {
  // Real safetensors dtypes refit.v1 has no enum for, and misspellings (the
  // format's names are upper case).
  for (const char* name : {"F64", "F8_E5M2", "I8", "I16", "U16", "BOOL", "bf16", "f32", ""}) {
    EXPECT_EQ(DTypeFromSafetensorsName(name), refit::v1::DTYPE_UNSPECIFIED) << name;
  }
  EXPECT_EQ(SafetensorsNameOf(refit::v1::DTYPE_UNSPECIFIED), "");
  EXPECT_EQ(DTypeBytes(refit::v1::DTYPE_UNSPECIFIED), 0u);
}

TEST_F(SafetensorsViewTest, ReportsNameDTypeShapeAndTheBytesOfEachTensor) {
  const std::string path =
      Write("m.safetensors",
            SafetensorsImage(R"({"w":{"dtype":"I32","shape":[2,3],"data_offsets":[0,24]},)"
                             R"("s":{"dtype":"F8_E4M3","shape":[],"data_offsets":[24,25]}})",
                             "0123456789abcdefghijklmnZ"));
  absl::StatusOr<std::unique_ptr<SafetensorsView>> view = SafetensorsView::Open(path);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ((*view)->path(), path);
  ASSERT_EQ((*view)->tensors().size(), 2u);
  const SafetensorsTensor& w = (*view)->tensors()[0];
  EXPECT_EQ(w.name, "w");
  EXPECT_EQ(w.dtype_name, "I32");
  EXPECT_EQ(w.dtype, refit::v1::DTYPE_I32);
  EXPECT_THAT(w.shape, ElementsAre(2, 3));
  EXPECT_EQ(*(*view)->ReadAll(w), "0123456789abcdefghijklmn");
  const SafetensorsTensor& scalar = (*view)->tensors()[1];
  EXPECT_EQ(scalar.name, "s");
  EXPECT_EQ(scalar.dtype, refit::v1::DTYPE_F8_E4M3);
  EXPECT_TRUE(scalar.shape.empty());
  ASSERT_EQ(scalar.nbytes, 1u);
  EXPECT_EQ(*(*view)->ReadAll(scalar), "Z");
}

TEST_F(SafetensorsViewTest, FileTruncatedAfterOpenIsFailedPreconditionNotSigbus) {
  const std::string path = Path("shrinks.safetensors");
  const std::string data(1 << 16, 'q');
  ASSERT_TRUE(WriteFileBytes(
      path, SafetensorsImage(R"({"a":{"dtype":"U8","shape":[32768],"data_offsets":[0,32768]},)"
                             R"("b":{"dtype":"U8","shape":[32768],"data_offsets":[32768,65536]}})",
                             data)));
  absl::StatusOr<std::unique_ptr<SafetensorsView>> view = SafetensorsView::Open(path);
  ASSERT_TRUE(view.ok()) << view.status();
  ASSERT_TRUE((*view)->ReadAll((*view)->tensors()[0]).ok());
  ASSERT_EQ(::truncate(path.c_str(), 200), 0);
  absl::StatusOr<std::string> read = (*view)->ReadAll((*view)->tensors()[1]);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kFailedPrecondition) << read.status();
  EXPECT_THAT(read.status().message(), HasSubstr(path));
  EXPECT_THAT(read.status().message(), HasSubstr("tensor 'b'"));
  EXPECT_THAT(read.status().message(), HasSubstr("changed while being read"));
}

TEST_F(SafetensorsViewTest, RejectsANulByteInTheHeader) {
  const std::string path = Path("nul.safetensors");
  ASSERT_TRUE(WriteFileBytes(
      path,
      SafetensorsImage(std::string(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})") +
                           std::string(1, '\0') + "junk",
                       "x")));
  absl::StatusOr<std::unique_ptr<SafetensorsView>> view = SafetensorsView::Open(path);
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument) << view.status();
  EXPECT_THAT(view.status().message(), HasSubstr("NUL byte"));
}

TEST_F(SafetensorsViewTest, HeaderOnlyFileHasNoTensors) {
  const std::string path = Write("empty.safetensors", SafetensorsImage("{}", ""));
  absl::StatusOr<std::unique_ptr<SafetensorsView>> view = SafetensorsView::Open(path);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_TRUE((*view)->tensors().empty());
}

TEST_F(SafetensorsViewTest, TruncatedFileIsInvalidArgumentNamingTheTensor) {
  const std::string whole =
      SafetensorsImage(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                       std::string(16, '\x02'));
  // Cut inside b's bytes, as an interrupted copy leaves a file.
  const std::string path = Write("cut.safetensors", whole.substr(0, whole.size() - 3));
  absl::StatusOr<std::unique_ptr<SafetensorsView>> view = SafetensorsView::Open(path);
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(view.status().message(), HasSubstr(path + ": "));
  EXPECT_THAT(view.status().message(),
              HasSubstr("tensor 'b': data_offsets [8, 16) outside the data section of 13 bytes"));

  // Cut inside the header: its length prefix runs past the end.
  const std::string header_cut = Write("header-cut.safetensors", whole.substr(0, 20));
  view = SafetensorsView::Open(header_cut);
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(view.status().message(), HasSubstr(header_cut + ": "));
  EXPECT_THAT(view.status().message(), HasSubstr("exceeds the file size 20"));
}

TEST_F(SafetensorsViewTest, ReadsTheFilesCoreWritesTensorForTensor) {
  const core::ModelConfig config = core::FixtureConfig();
  const std::string out = Path("fixture");
  ASSERT_TRUE(core::WriteFixtureModel(out, config, /*seed=*/3, /*num_files=*/2).ok());
  absl::StatusOr<std::vector<std::string>> files = ExpandSafetensorsPaths({out});
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_EQ(files->size(), 2u);
  absl::StatusOr<std::vector<core::OwnedTensor>> weights = core::MakeFixtureWeights(config, 3);
  ASSERT_TRUE(weights.ok()) << weights.status();
  std::map<std::string, const core::OwnedTensor*> expected;
  for (const core::OwnedTensor& t : *weights) expected[t.name] = &t;

  size_t seen = 0;
  for (const std::string& file : *files) {
    absl::StatusOr<std::unique_ptr<SafetensorsView>> view = SafetensorsView::Open(file);
    ASSERT_TRUE(view.ok()) << view.status();
    for (const SafetensorsTensor& t : (*view)->tensors()) {
      SCOPED_TRACE(t.name);
      auto it = expected.find(t.name);
      ASSERT_NE(it, expected.end());
      const core::OwnedTensor& want = *it->second;
      EXPECT_EQ(t.dtype_name, core::DTypeName(want.dtype));
      EXPECT_EQ(t.shape, want.shape);
      ASSERT_EQ(t.nbytes, want.bytes.size());
      absl::StatusOr<std::string> bytes = (*view)->ReadAll(t);
      ASSERT_TRUE(bytes.ok()) << bytes.status();
      EXPECT_EQ(std::memcmp(bytes->data(), want.bytes.data(), want.bytes.size()), 0);
      ++seen;
    }
  }
  EXPECT_EQ(seen, expected.size());
}

}  // namespace
}  // namespace refit::client
