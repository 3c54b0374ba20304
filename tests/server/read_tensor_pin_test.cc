// ReadTensorRequest.version: a read pinned to the live version streams the
// tensor; pinned to another version it is ABORTED before any byte, so reads
// of many tensors pinned to one version never mix versions.
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/server_test_util.h"

namespace refit::server::testing {
namespace {

using ::testing::HasSubstr;

constexpr char kTensor[] = "model.layers.0.self_attn.qkv_proj.weight";

// Reads kTensor pinned to `version` (and `fingerprint` unless empty); the
// first message's fingerprint goes to *served.
grpc::Status ReadPinned(v1::RefitService::Stub* stub, uint64_t version, std::string* bytes,
                        const std::string& fingerprint = "", std::string* served = nullptr) {
  grpc::ClientContext context;
  v1::ReadTensorRequest request;
  request.set_name(kTensor);
  request.set_version(version);
  if (!fingerprint.empty()) request.set_fingerprint(fingerprint);
  std::unique_ptr<grpc::ClientReader<v1::ReadTensorResponse>> reader =
      stub->ReadTensor(&context, request);
  v1::ReadTensorResponse message;
  bool first = true;
  while (reader->Read(&message)) {
    EXPECT_EQ(message.version(), version);
    if (first && served != nullptr) *served = message.fingerprint();
    first = false;
    bytes->append(message.data());
  }
  return reader->Finish();
}

class ReadTensorPinTest : public ServerTest {};

TEST_F(ReadTensorPinTest, PinnedToTheLiveVersionReadsTheTensor) {
  std::string bytes;
  const grpc::Status status = ReadPinned(stub_.get(), 1, &bytes);
  ASSERT_TRUE(status.ok()) << status.error_message();
  std::string live;
  ASSERT_TRUE(server_->default_group()->store()->ReadKernel(kTensor, &live, nullptr).ok());
  EXPECT_EQ(bytes, live);
}

TEST_F(ReadTensorPinTest, PinnedToAnotherVersionIsAbortedNamingBoth) {
  ASSERT_TRUE(PushMessages(stub_.get(), FullPush(2)).status.ok());
  std::string bytes;
  const grpc::Status status = ReadPinned(stub_.get(), 1, &bytes);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(status.error_message(), HasSubstr("pinned to version 1 but version 2 is live"));
  EXPECT_TRUE(bytes.empty());
}

TEST_F(ReadTensorPinTest, PinnedToAFingerprintReadsOnlyThatContent) {
  // The same version number with other weights (a daemon restarted without
  // --state-dir counts from 1 again) is not the pinned version.
  const std::string live = Status(stub_.get()).fingerprint();
  std::string bytes, served;
  grpc::Status status = ReadPinned(stub_.get(), 1, &bytes, live, &served);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(served, live);
  bytes.clear();
  status = ReadPinned(stub_.get(), 1, &bytes, "0123456789abcdef");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(status.error_message(),
              HasSubstr("pinned to fingerprint \"0123456789abcdef\" but version 1 (fingerprint " +
                        live + ") is live"));
  EXPECT_TRUE(bytes.empty());
}

}  // namespace
}  // namespace refit::server::testing
