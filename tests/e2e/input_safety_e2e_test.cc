// End-to-end input safety with a real refitd process: a checkpoint truncated
// while the daemon reads it for a Reload fails that Reload (the daemon lives
// on, the version stays), and a tensor name that carries a newline cannot
// forge a record in the daemon's log.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/refit_client.h"
#include "core/fixture_model.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "refit/v1/refit.grpc.pb.h"
#include "tests/e2e/e2e_util.h"
#include "tests/testing/temp_dir.h"

namespace refit::e2e {
namespace {

using ::testing::HasSubstr;

class InputSafetyE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!std::filesystem::exists(BinPath("refitd"))) {
      GTEST_SKIP() << BinPath("refitd") << " is not built";
    }
    char pattern[] = "/tmp/refit_input_e2e_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
    socket_ = "unix:" + dir_ + "/refitd.sock";
    root_ = dir_ + "/root";
    std::filesystem::create_directories(root_);
  }

  void TearDown() override {
    daemon_.reset();  // SIGKILLs it if still running
    if (!dir_.empty() && !HasFailure()) refit::testing::RemoveTree(dir_);
    if (HasFailure()) std::cerr << "e2e: files kept in " << dir_ << "\n";
  }

  void StartDaemon() {
    daemon_ = Child::Start(
        {BinPath("refitd"), "--model=demo", "--listen=" + socket_, "--reload-root=" + root_},
        dir_ + "/refitd.out", dir_ + "/refitd.log");
    ASSERT_NE(daemon_, nullptr);
    ASSERT_TRUE(daemon_->AwaitStderr("ready")) << daemon_->Stderr();
    ASSERT_TRUE(daemon_->running()) << daemon_->Stderr();
    stub_ =
        v1::RefitService::NewStub(grpc::CreateChannel(socket_, grpc::InsecureChannelCredentials()));
  }

  uint64_t Version() {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::GetStatusRequest request;
    v1::GetStatusResponse response;
    grpc::Status status = stub_->GetStatus(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.version();
  }

  std::string dir_, socket_, root_;
  std::unique_ptr<Child> daemon_;
  std::unique_ptr<v1::RefitService::Stub> stub_;
};

TEST_F(InputSafetyE2eTest, CheckpointTruncatedDuringReloadFailsTheReloadNotTheDaemon) {
  const std::string ckpt = root_ + "/ckpt";
  ASSERT_TRUE(core::WriteFixtureModel(ckpt, core::FixtureConfig(), 9, 1).ok());
  const std::string shard = ckpt + "/model-00001-of-00001.safetensors";
  // The daemon's reader stops after the first tensor until this FIFO is
  // opened for writing (its test hook), so the truncation lands mid-read.
  const std::string fifo = dir_ + "/pause.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(::setenv("REFITD_TEST_RELOAD_PAUSE_FIFO", fifo.c_str(), 1), 0);
  StartDaemon();
  ::unsetenv("REFITD_TEST_RELOAD_PAUSE_FIFO");
  if (HasFatalFailure()) return;

  grpc::Status reload_status;
  std::thread reload([&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::ReloadRequest request;
    request.set_path(ckpt);
    request.mutable_options()->set_completion(v1::COMPLETION_MODE_COMMIT);
    request.mutable_options()->set_non_finite(v1::NON_FINITE_POLICY_REJECT);
    auto reader = stub_->Reload(&context, request);
    v1::ReloadProgress progress;
    while (reader->Read(&progress)) {
    }
    reload_status = reader->Finish();
  });
  const bool paused = daemon_->AwaitStderr("Reload paused after the first tensor");
  if (paused) {
    // What a trainer rewriting its checkpoint in place does to a reader: the
    // mapped pages past the new end are gone (SIGBUS for a mapping reader).
    struct stat st;
    EXPECT_EQ(::stat(shard.c_str(), &st), 0);
    EXPECT_EQ(::truncate(shard.c_str(), st.st_size / 4), 0);
  }
  // Let the reader go on (or, if it never paused, let the thread finish).
  const int fd = ::open(fifo.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd >= 0) ::close(fd);
  reload.join();
  ASSERT_TRUE(paused) << daemon_->Stderr();

  EXPECT_EQ(reload_status.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << reload_status.error_message();
  EXPECT_THAT(reload_status.error_message(), HasSubstr(shard));
  EXPECT_THAT(reload_status.error_message(), HasSubstr("changed while being read"));
  ASSERT_TRUE(daemon_->running()) << "refitd died:\n" << daemon_->Stderr();
  EXPECT_EQ(Version(), 1u);
}

TEST_F(InputSafetyE2eTest, ANewlineInATensorNameCannotForgeALogRecord) {
  StartDaemon();
  if (HasFatalFailure()) return;
  const std::string forged = "2026-01-01T00:00:00.000000Z INFO refit_id=r-x FORGED committed";
  grpc::ClientContext context;
  v1::PushResponse response;
  auto writer = stub_->Push(&context, &response);
  v1::PushRequest begin;
  begin.mutable_begin()->mutable_options()->set_completion(v1::COMPLETION_MODE_COMMIT);
  begin.mutable_begin()->mutable_options()->set_non_finite(v1::NON_FINITE_POLICY_REJECT);
  begin.mutable_begin()->mutable_options()->set_label(absl::StrCat("label\n", forged));
  ASSERT_TRUE(writer->Write(begin));
  v1::PushRequest chunks;
  v1::Chunk* chunk = chunks.mutable_chunks()->add_chunks();
  chunk->set_tensor_name(absl::StrCat("x\n", forged));
  chunk->set_dtype(v1::DTYPE_BF16);
  chunk->add_shape(1);
  chunk->set_data(std::string(2, '\0'));
  writer->Write(chunks);
  writer->WritesDone();
  grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("\"x\\n2026-01-01"));
  // The daemon logged the failure; no line of its log starts with the forged
  // record, and the escaped name is there.
  ASSERT_TRUE(daemon_->AwaitStderr("x\\n2026-01-01")) << daemon_->Stderr();
  for (absl::string_view line : absl::StrSplit(daemon_->Stderr(), '\n')) {
    EXPECT_FALSE(absl::StartsWith(line, "2026-01-01T00:00:00.000000Z")) << line;
    EXPECT_FALSE(absl::StrContains(line, "FORGED") && !absl::StrContains(line, "\\n")) << line;
  }
  EXPECT_TRUE(daemon_->running());
  EXPECT_EQ(Version(), 1u);
}

}  // namespace
}  // namespace refit::e2e
