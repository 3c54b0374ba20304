// Fault tests with real processes: a refitd on a Unix socket, trainers that
// die in the middle of a push (e2e_fault_pusher, SIGKILLed at chosen points)
// and readers that stream tensors while commits happen. What they hold:
//   - a pusher killed anywhere before End changes nothing: version and
//     fingerprint stay, the refit slot is free, the next refit succeeds;
//   - every ReadTensor stream is one version, byte for byte that version's
//     tensor, also when a commit completes while the stream is open (counted:
//     the test makes such overlaps happen and asserts that some did). Such a
//     stream either completes with the old version's bytes or ends ABORTED
//     after a prefix of them; it never carries bytes of two versions.
// See tests/e2e/e2e_util.h for the ground rules (events, no sleeps).
#include <stdlib.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/refit_client.h"
#include "client/safetensors_view.h"
#include "gtest/gtest.h"
#include "tests/e2e/e2e_util.h"
#include "tests/testing/temp_dir.h"

namespace refit::e2e {
namespace {

class PusherFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const std::string& bin :
         {BinPath("refitd"), BinPath("refitctl"), BinPath("refit_make_fixture"),
          TestBinPath("e2e_fault_pusher")}) {
      if (!std::filesystem::exists(bin)) GTEST_SKIP() << bin << " is not built";
    }
    char pattern[] = "/tmp/refit_fault_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern), nullptr);
    dir_ = pattern;
    socket_ = "unix:" + dir_ + "/refitd.sock";
    daemon_ = Child::Start({BinPath("refitd"), "--model=demo", "--listen=" + socket_},
                           Path("refitd.out"), Path("refitd.log"));
    ASSERT_NE(daemon_, nullptr);
    const bool ready = daemon_->AwaitStderr("ready");
    ASSERT_TRUE(ready && daemon_->running()) << "refitd did not become ready:\n"
                                             << daemon_->Stderr();
    client::ClientOptions options;
    options.address = socket_;
    options.timeout = absl::Seconds(30);
    auto c = client::RefitClient::Create(options);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  void TearDown() override {
    client_.reset();
    daemon_.reset();  // SIGKILLs it if still running
    if (!dir_.empty() && !HasFailure()) refit::testing::RemoveTree(dir_);
    if (HasFailure()) std::cerr << "e2e: files kept in " << dir_ << "\n";
  }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  // The fixture model with `seed`, written once.
  std::string Fixture(int seed) {
    const std::string out = Path(absl::StrCat("weights-", seed));
    if (std::filesystem::exists(out)) return out;
    auto child =
        Child::Start({BinPath("refit_make_fixture"), "--out=" + out, absl::StrCat("--seed=", seed)},
                     Path("fixture.out"), Path("fixture.err"));
    EXPECT_EQ(child->Wait(), 0) << child->Stderr();
    return out;
  }

  absl::StatusOr<v1::RefitResult> PushFixture(int seed) {
    auto files = client::ExpandSafetensorsPaths({Fixture(seed)});
    if (!files.ok()) return files.status();
    client::PushOptions options;
    options.label = absl::StrCat("seed-", seed);
    return client_->PushFiles(*files, options);
  }

  v1::GetStatusResponse Status() {
    auto status = client_->GetStatus();
    EXPECT_TRUE(status.ok()) << status.status();
    return status.ok() ? *status : v1::GetStatusResponse();
  }

  std::string dir_;
  std::string socket_;
  std::unique_ptr<Child> daemon_;
  std::unique_ptr<client::RefitClient> client_;
};

TEST_F(PusherFaultTest, PusherKilledAtRandomPointsChangesNothingAndTheNextRefitSucceeds) {
  constexpr int kKills = 24;
  const uint64_t seed = std::random_device()();
  SCOPED_TRACE(absl::StrCat("kill points drawn with seed ", seed));
  std::mt19937_64 rng(seed);
  // The killed pushes carry seed 4's weights, the refits after them 2 and 3
  // in turn: each differs from the live version, so each commit must change
  // the fingerprint, and seed 4's fingerprint must never appear.
  const std::string killed_weights = Fixture(4);
  std::map<int, std::string> fingerprint_of;  // fixture seed -> fingerprint once committed
  std::set<size_t> points;
  // The pusher stops after 1 + POINT % (N - 1) of its N messages. The first
  // kill is right after Begin (POINT 0), which tells the test N; the second
  // after every chunk but before End (POINT N - 2); the others at distinct
  // random points in between.
  std::vector<uint64_t> draws = {0};
  int64_t messages = 0;
  for (int i = 0; i < kKills; ++i) {
    SCOPED_TRACE(absl::StrCat("kill ", i));
    const v1::GetStatusResponse before = Status();
    auto watch = WatchStream::Open(socket_);
    ASSERT_NE(watch, nullptr);
    auto pusher = Child::Start(
        {TestBinPath("e2e_fault_pusher"), socket_, killed_weights, absl::StrCat(draws[i])},
        Path(absl::StrCat("pusher-", i, ".out")), Path(absl::StrCat("pusher-", i, ".err")),
        /*stdin_pipe=*/true);
    ASSERT_NE(pusher, nullptr);
    // "messages N\nstopped K\n": the pusher has written K messages.
    const bool at_point = pusher->AwaitOutput([](const std::string& out, const std::string&) {
      const size_t at = out.find("\nstopped ");
      return at != std::string::npos && out.find('\n', at + 1) != std::string::npos;
    });
    const std::string out = pusher->Stdout();
    ASSERT_TRUE(at_point) << out << pusher->Stderr();
    size_t stopped = 0;
    const size_t at = out.find("\nstopped ") + 9;
    ASSERT_TRUE(absl::SimpleAtoi(out.substr(at, out.find('\n', at) - at), &stopped)) << out;
    if (messages == 0) {
      ASSERT_TRUE(absl::SimpleAtoi(out.substr(9, out.find('\n') - 9), &messages)) << out;
      ASSERT_GT(messages, kKills + 2) << "the push should span many messages";
      std::vector<uint64_t> middle;
      for (int64_t p = 1; p < messages - 2; ++p) middle.push_back(p);
      std::shuffle(middle.begin(), middle.end(), rng);
      draws.push_back(messages - 2);
      draws.insert(draws.end(), middle.begin(), middle.begin() + (kKills - 2));
    }
    points.insert(stopped);
    // Begin was written; the refit is the active one once staging started.
    std::optional<v1::WatchEvent> started = watch->Next(v1::WatchEvent::TYPE_STAGING_STARTED);
    ASSERT_TRUE(started.has_value()) << "the killed pusher's refit never started";

    pusher->Signal(SIGKILL);
    ASSERT_FALSE(pusher->Wait().has_value());
    ASSERT_TRUE(pusher->KilledBySignal(SIGKILL));
    std::optional<v1::WatchEvent> aborted = watch->Next(v1::WatchEvent::TYPE_ABORTED);
    ASSERT_TRUE(aborted.has_value())
        << "the killed push (stopped after " << stopped << " messages) was never aborted";
    EXPECT_EQ(aborted->refit_id(), started->refit_id());

    const v1::GetStatusResponse after = Status();
    EXPECT_EQ(after.version(), before.version()) << "stopped after " << stopped << " messages";
    EXPECT_EQ(after.fingerprint(), before.fingerprint()) << "stopped after " << stopped;
    EXPECT_FALSE(after.has_active_refit()) << "the killed push's refit still holds the slot";
    ASSERT_TRUE(daemon_->running()) << daemon_->Stderr();

    const int next = 2 + i % 2;
    absl::StatusOr<v1::RefitResult> pushed = PushFixture(next);
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    EXPECT_EQ(pushed->version(), before.version() + 1);
    auto [it, first] = fingerprint_of.emplace(next, pushed->fingerprint());
    if (!first) {
      EXPECT_EQ(pushed->fingerprint(), it->second) << "seed " << next;
    }
    EXPECT_NE(pushed->fingerprint(), before.fingerprint());
    const v1::GetStatusResponse committed = Status();
    EXPECT_EQ(committed.version(), pushed->version());
    EXPECT_EQ(committed.fingerprint(), pushed->fingerprint());
  }
  EXPECT_EQ(points.size(), static_cast<size_t>(kKills)) << "of " << messages << " messages";
  EXPECT_TRUE(points.count(1) && points.count(messages - 1)) << "Begin only; all but End";
}

// One ReadTensor stream as the wire carries it.
struct StreamRead {
  grpc::Status status;
  std::set<uint64_t> versions;  // of every message
  std::string data;
  bool overlapped = false;  // a commit completed while it was open
};

TEST_F(PusherFaultTest, ReadersOverlappingCommitsSeeOneVersionPerStream) {
  // Two versions to alternate between, and the bytes each serves.
  const std::string tensor = "model.embed_tokens.weight";
  std::map<int, std::string> bytes_of;  // fixture seed -> kernel bytes
  std::map<uint64_t, int> seed_of;      // version -> fixture seed
  for (int seed : {2, 3}) {
    absl::StatusOr<v1::RefitResult> pushed = PushFixture(seed);
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    auto read = client_->ReadTensor("", tensor);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_EQ(read->version, pushed->version());
    ASSERT_GE(read->data.size(), size_t{64} << 10);
    bytes_of[seed] = read->data;
    seed_of[pushed->version()] = seed;
  }
  ASSERT_NE(bytes_of[2], bytes_of[3]);

  // The pusher commits 2, 3, 2, ... back to back until the readers are done.
  absl::Mutex mu;
  uint64_t commits = 0;
  bool readers_done = false;
  absl::Status push_error;
  std::thread pusher([&] {
    for (int i = 0;; ++i) {
      {
        absl::MutexLock lock(&mu);
        if (readers_done || i >= 2000) return;
      }
      const int seed = 2 + i % 2;
      absl::StatusOr<v1::RefitResult> pushed = PushFixture(seed);
      absl::MutexLock lock(&mu);
      if (!pushed.ok()) {
        push_error = pushed.status();
        return;
      }
      seed_of[pushed->version()] = seed;
      ++commits;
    }
  });

  auto stub =
      v1::RefitService::NewStub(grpc::CreateChannel(socket_, grpc::InsecureChannelCredentials()));
  // Reads one stream in small messages. With `hold`, it waits after the first
  // message for the pusher's next commit (bounded), then asks GetStatus: a
  // newer version there, with the stream still to be finished, means a
  // commit completed inside the stream's lifetime.
  auto read_stream = [&](bool hold) {
    StreamRead r;
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    v1::ReadTensorRequest request;
    request.set_name(tensor);
    request.set_max_chunk_bytes(64 << 10);  // the daemon's smallest: 4+ messages
    auto reader = stub->ReadTensor(&context, request);
    v1::ReadTensorResponse message;
    bool first = true;
    while (reader->Read(&message)) {
      r.versions.insert(message.version());
      EXPECT_EQ(message.byte_offset(), r.data.size());
      r.data += message.data();
      if (first && hold) {
        first = false;
        bool committed = false;
        {
          absl::MutexLock lock(&mu);
          const uint64_t seen = commits;
          auto next_commit = [&] { return commits > seen || !push_error.ok(); };
          mu.AwaitWithTimeout(absl::Condition(&next_commit), absl::Seconds(10));
          committed = commits > seen;
        }
        if (committed) {
          auto status = client_->GetStatus();
          r.overlapped = status.ok() && status->version() > message.version();
        }
      }
    }
    r.status = reader->Finish();
    return r;
  };

  std::vector<StreamRead> held, free_running;
  std::thread racer([&] {
    for (;;) {
      {
        absl::MutexLock lock(&mu);
        if (readers_done) return;
      }
      free_running.push_back(read_stream(false));
    }
  });
  for (int i = 0; i < 30; ++i) held.push_back(read_stream(true));
  {
    absl::MutexLock lock(&mu);
    readers_done = true;
  }
  racer.join();
  pusher.join();
  ASSERT_TRUE(push_error.ok()) << push_error;

  int overlaps = 0, streams = 0, aborted = 0;
  for (const std::vector<StreamRead>* reads : {&held, &free_running}) {
    for (const StreamRead& r : *reads) {
      ++streams;
      // OK, or ABORTED because a commit landed between two of its chunks.
      const bool cut = r.status.error_code() == grpc::StatusCode::ABORTED;
      ASSERT_TRUE(r.status.ok() || cut) << r.status.error_code() << " " << r.status.error_message();
      aborted += cut;
      overlaps += r.overlapped || cut;
      ASSERT_LE(r.versions.size(), 1u) << "a stream saw " << r.versions.size() << " versions";
      if (r.versions.empty()) {
        ASSERT_TRUE(cut) << "a complete stream without a message";
        continue;
      }
      const uint64_t version = *r.versions.begin();
      ASSERT_TRUE(seed_of.count(version)) << "version " << version << " was never committed";
      const std::string& expected = bytes_of[seed_of[version]];
      if (cut) {
        EXPECT_TRUE(absl::StartsWith(expected, r.data))
            << "an aborted stream of version " << version << " is not a prefix of its tensor";
      } else {
        EXPECT_TRUE(r.data == expected)
            << "stream of version " << version << " is not that version's tensor";
      }
    }
  }
  std::cerr << "readers: " << streams << " streams, " << overlaps << " overlapped a commit ("
            << aborted << " of them ended ABORTED), over " << commits << " commits\n";
  EXPECT_GT(overlaps, 0) << "no stream was open across a commit; the test proved nothing";
  EXPECT_GT(commits, 0u);
}

}  // namespace
}  // namespace refit::e2e
