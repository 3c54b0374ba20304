// Option parsing helpers and the tokens-file parser: no server needed.
#include <unistd.h>

#include <climits>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "server/auth.h"
#include "server/server_options.h"
#include "tests/testing/temp_dir.h"

namespace refit::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(ServerOptionsTest, SplitsCommaSeparatedAndRepeatedAddresses) {
  EXPECT_THAT(SplitListenAddresses({"127.0.0.1:1, unix:/tmp/a.sock", "[::1]:3", ""}),
              ElementsAre("127.0.0.1:1", "unix:/tmp/a.sock", "[::1]:3"));
}

TEST(ServerOptionsTest, ParsesAGroupWithItsKeysOverTheDefaults) {
  GroupOptions defaults;
  defaults.device = "cuda:1";
  defaults.quant = "per-channel";
  absl::StatusOr<GroupOptions> group =
      ParseGroupSpec("draft=/ckpt/draft,tp=2,tp-rank=1,seed=9,host-staging=true", defaults);
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_EQ(group->name, "draft");
  EXPECT_EQ(group->model, "/ckpt/draft");
  EXPECT_EQ(group->tp_size, 2);
  EXPECT_EQ(group->tp_rank, 1);
  EXPECT_EQ(group->demo_seed, 9u);
  EXPECT_TRUE(group->host_staging);
  EXPECT_EQ(group->device, "cuda:1");  // from the defaults
  EXPECT_EQ(group->quant, "per-channel");
  absl::StatusOr<GroupOptions> plain = ParseGroupSpec("target=demo", defaults);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->model, "demo");
  EXPECT_EQ(plain->tp_size, 1);
}

TEST(ServerOptionsTest, RefusesMalformedGroups) {
  const struct {
    const char* spec;
    const char* why;
  } cases[] = {
      {"draft", "no '='"},
      {"=demo", "model group name \"\""},
      {"dr/aft=demo", "model group name \"dr/aft\""},
      {"..=demo", "model group name \"..\""},
      {"draft=", "no model"},
      {"draft=demo,tp", "\"tp\" is not key=value"},
      {"draft=demo,tp=two", "tp=two is not a non-negative integer"},
      {"draft=demo,color=red", "unknown key \"color\""},
      {"draft=demo,host-staging=yes", "host-staging=yes is not true or false"},
  };
  for (const auto& c : cases) {
    absl::StatusOr<GroupOptions> group = ParseGroupSpec(c.spec, GroupOptions());
    EXPECT_EQ(group.status().code(), absl::StatusCode::kInvalidArgument) << c.spec;
    EXPECT_THAT(group.status().message(), HasSubstr(c.why)) << c.spec;
    EXPECT_THAT(group.status().message(), HasSubstr(absl::StrCat("--group \"", c.spec, "\"")));
  }
}

TEST(ServerOptionsTest, WithoutGroupsTheSingleGroupFieldsMakeTheDefaultGroup) {
  ServerOptions options;
  options.model = "/ckpt";
  options.tp_size = 4;
  options.tp_rank = 3;
  std::vector<GroupOptions> groups = EffectiveGroups(options);
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0].name, kDefaultGroup);
  EXPECT_EQ(groups[0].model, "/ckpt");
  EXPECT_EQ(groups[0].tp_size, 4);
  EXPECT_EQ(groups[0].tp_rank, 3);
  EXPECT_EQ(GroupHealthName("draft"), "refit.v1.RefitService/draft");
}

TEST(ServerOptionsTest, ListenAddressesNeedAPortInRange) {
  for (const char* ok : {"127.0.0.1:0", "127.0.0.1:50051", "0.0.0.0:65535", "[::1]:50051",
                         "localhost:1", "unix:/tmp/refitd.sock", "unix-abstract:refitd"}) {
    EXPECT_TRUE(ValidateListenAddress(ok, "--listen").ok()) << ok;
  }
  for (const char* bad : {"127.0.0.1:500510", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:",
                          "127.0.0.1:http", "127.0.0.1", "[::1]:99999", "[::1]", "::1:5"}) {
    absl::Status status = ValidateListenAddress(bad, "--listen");
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("--listen address \"", bad, "\"")));
  }
  EXPECT_THAT(ValidateListenAddress("127.0.0.1:500510", "--listen").message(),
              HasSubstr("port \"500510\" is not a number in 0..65535"));
}

TEST(ServerOptionsTest, TheDescriptorSocketOfARelativeUnixPathIsToldAbsolute) {
  // Clients in another working directory are told where it is.
  char cwd[PATH_MAX];
  ASSERT_NE(::getcwd(cwd, sizeof(cwd)), nullptr);
  EXPECT_EQ(DescriptorSocketPath({"unix:r.sock"}), absl::StrCat(cwd, "/r.sock.fd"));
  EXPECT_EQ(DescriptorSocketPath({"unix:run/r.sock"}), absl::StrCat(cwd, "/run/r.sock.fd"));
}

TEST(ServerOptionsTest, TheDescriptorSocketOfARelativePathInADeepDirectoryStaysRelative) {
  // Absolute, it would not fit a socket address; relative, it does, and
  // clients in the same directory reach it (the daemon starts).
  char cwd[PATH_MAX];
  ASSERT_NE(::getcwd(cwd, sizeof(cwd)), nullptr);
  const std::string deep =
      absl::StrCat(::testing::TempDir(), "/refit-deep-", ::getpid(), "/", std::string(100, 'd'));
  ASSERT_TRUE(testing::MakeDirs(deep));
  ASSERT_EQ(::chdir(deep.c_str()), 0);
  const std::string fd_path = DescriptorSocketPath({"unix:r.sock"});
  const absl::Status valid = ValidateListenAddresses({"unix:r.sock"});
  ASSERT_EQ(::chdir(cwd), 0);
  testing::RemoveTree(deep.substr(0, deep.rfind('/')));
  EXPECT_EQ(fd_path, "r.sock.fd");
  EXPECT_TRUE(valid.ok()) << valid;
}

TEST(ServerOptionsTest, UnixPathsAndTheDescriptorSocketBesideThemMustFit) {
  // sun_path holds 108 bytes with the terminating NUL: 107 for the path,
  // 104 for a path that also needs its ".fd" sibling.
  const std::string fits = "/" + std::string(103, 'a');
  const std::string no_room_for_fd = "/" + std::string(104, 'a');
  const std::string too_long = "/" + std::string(107, 'a');
  EXPECT_TRUE(ValidateListenAddresses({"unix:" + fits}).ok());
  EXPECT_EQ(DescriptorSocketPath({"127.0.0.1:0", "unix-abstract:x", "unix:" + fits, "unix:/b"}),
            fits + ".fd");
  EXPECT_EQ(DescriptorSocketPath({"127.0.0.1:0", "unix-abstract:x"}), "");
  EXPECT_EQ(DescriptorSocketPath({"unix:///run/r.sock"}), "/run/r.sock.fd");

  absl::Status status = ValidateListenAddresses({"unix:" + no_room_for_fd});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("the descriptor socket for engine attach "
                                                       "and trainer regions, ",
                                                       no_room_for_fd, ".fd")));
  EXPECT_THAT(status.message(), HasSubstr("the path is 108 bytes; 1 to 107 fit a Unix socket"));
  // Only the first unix: path has a descriptor socket beside it.
  EXPECT_TRUE(ValidateListenAddresses({"unix:/r.sock", "unix:" + no_room_for_fd}).ok());

  status = ValidateListenAddresses({"127.0.0.1:0", "unix:" + too_long});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr(absl::StrCat("--listen address \"unix:", too_long,
                                                       "\": the path is 108 bytes")));
  status = ValidateListenAddresses({"unix-abstract:" + std::string(108, 'n')});
  EXPECT_THAT(status.message(), HasSubstr("the name is 108 bytes"));
  EXPECT_THAT(ValidateListenAddresses({"unix:"}).message(), HasSubstr("the path is 0 bytes"));
  EXPECT_THAT(ValidateListenAddresses({"127.0.0.1:65536"}).message(),
              HasSubstr("--listen address \"127.0.0.1:65536\""));
}

TEST(ServerOptionsTest, LoopbackAddresses) {
  EXPECT_TRUE(IsLoopbackAddress("127.0.0.1:50051"));
  EXPECT_TRUE(IsLoopbackAddress("127.1.2.3:0"));
  EXPECT_TRUE(IsLoopbackAddress("localhost:50051"));
  EXPECT_TRUE(IsLoopbackAddress("[::1]:50051"));
  EXPECT_TRUE(IsLoopbackAddress("unix:/run/refitd.sock"));
  EXPECT_FALSE(IsLoopbackAddress("0.0.0.0:50051"));
  EXPECT_FALSE(IsLoopbackAddress("[::]:50051"));
  EXPECT_FALSE(IsLoopbackAddress("10.0.0.5:50051"));
  EXPECT_FALSE(IsLoopbackAddress(":50051"));
}

TEST(ServerOptionsTest, ParsesByteSizes) {
  EXPECT_EQ(*ParseByteSize("4096"), 4096);
  EXPECT_EQ(*ParseByteSize("64MiB"), int64_t{64} << 20);
  EXPECT_EQ(*ParseByteSize("64M"), int64_t{64} << 20);
  EXPECT_EQ(*ParseByteSize("4GiB"), int64_t{4} << 30);
  EXPECT_EQ(*ParseByteSize("512k"), int64_t{512} << 10);
  EXPECT_EQ(ParseByteSize("lots").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseByteSize("12X").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseByteSize("99999999999T").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AuthenticatorTest, ParsesTokensFile) {
  absl::StatusOr<std::unique_ptr<Authenticator>> auth = Authenticator::FromText(
      "# tokens\n"
      "t1 trainer alice   # the trainer\n"
      "\n"
      "o1 operator\n"
      "r1 reader bob\n",
      "tokens.txt");
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_TRUE((*auth)->enabled());
  absl::StatusOr<Principal> alice = (*auth)->Authorize("Bearer t1", Action::kPush, "Push");
  ASSERT_TRUE(alice.ok());
  EXPECT_EQ(alice->name, "alice");
  EXPECT_EQ(alice->role, Role::kTrainer);
  absl::StatusOr<Principal> op = (*auth)->Authorize("bearer o1", Action::kReload, "Reload");
  ASSERT_TRUE(op.ok());
  EXPECT_EQ(op->name, "operator@tokens.txt:4");
}

TEST(AuthenticatorTest, RejectsMalformedFiles) {
  auto bad_role = Authenticator::FromText("t1 admin\n", "f");
  EXPECT_EQ(bad_role.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_role.status().message(), HasSubstr("f:1"));
  EXPECT_THAT(bad_role.status().message(), HasSubstr("admin"));
  auto one_field = Authenticator::FromText("# c\nt1\n", "f");
  EXPECT_EQ(one_field.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(one_field.status().message(), HasSubstr("f:2"));
  auto repeated = Authenticator::FromText("t1 reader\nt1 trainer\n", "f");
  EXPECT_EQ(repeated.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Authenticator::FromText("# nothing\n", "f").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Authenticator::FromFile("/nonexistent/tokens").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(AuthenticatorTest, RoleMatrix) {
  auto auth = *Authenticator::FromText("t trainer\no operator\nr reader\n", "f");
  struct Case {
    const char* token;
    Action action;
    bool allowed;
  };
  const Case cases[] = {
      {"t", Action::kPush, true},    {"t", Action::kFinish, true},  {"t", Action::kReload, false},
      {"t", Action::kRead, false},   {"o", Action::kPush, true},    {"o", Action::kFinish, true},
      {"o", Action::kReload, true},  {"o", Action::kRead, true},    {"r", Action::kPush, false},
      {"r", Action::kFinish, false}, {"r", Action::kReload, false}, {"r", Action::kRead, true},
  };
  for (const Case& c : cases) {
    absl::Status status = auth->Authorize(absl::StrCat("Bearer ", c.token), c.action, "M").status();
    if (c.allowed) {
      EXPECT_TRUE(status.ok()) << c.token << " " << static_cast<int>(c.action);
    } else {
      EXPECT_EQ(status.code(), absl::StatusCode::kPermissionDenied)
          << c.token << " " << static_cast<int>(c.action);
    }
  }
  EXPECT_EQ(auth->Authorize(std::nullopt, Action::kRead, "M").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth->Authorize("Bearer nope", Action::kRead, "M").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth->Authorize("Basic r", Action::kRead, "M").status().code(),
            absl::StatusCode::kUnauthenticated);
}

TEST(AuthenticatorTest, AllowAllIsAnonymousOperator) {
  auto auth = Authenticator::AllowAll();
  absl::StatusOr<Principal> p = auth->Authorize(std::nullopt, Action::kReload, "Reload");
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->authenticated);
  EXPECT_TRUE(Authenticator::CheckOwner(*p, "someone", "r-1", "Commit").ok());
}

TEST(AuthenticatorTest, TrainersFinishOnlyTheirOwnRefits) {
  Principal alice{"alice", Role::kTrainer, true};
  Principal op{"ops", Role::kOperator, true};
  EXPECT_TRUE(Authenticator::CheckOwner(alice, "alice", "r-1", "Commit").ok());
  absl::Status other = Authenticator::CheckOwner(alice, "bob", "r-1", "Commit");
  EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(other.message(), HasSubstr("r-1"));
  EXPECT_TRUE(Authenticator::CheckOwner(op, "bob", "r-1", "Abort").ok());
}

}  // namespace
}  // namespace refit::server
