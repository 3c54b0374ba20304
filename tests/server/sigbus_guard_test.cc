// SigbusGuard: a read past the end of a guarded mapping whose file shrank
// reads zeros and flags the range instead of killing the process; the whole
// range reads zeros from then on; a fault outside every guarded range still
// ends the process with SIGBUS; slots are reused after Unregister.
#include "server/sigbus_guard.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace refit::server {
namespace {

// A file of `pages` pages of 'x' in /dev/shm (unlinked), mapped shared.
struct ShmFile {
  explicit ShmFile(size_t pages) {
    page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    length = pages * page;
    char path[] = "/dev/shm/refit-sigbus-XXXXXX";
    fd = ::mkstemp(path);
    ::unlink(path);
    std::vector<char> bytes(length, 'x');
    EXPECT_EQ(::pwrite(fd, bytes.data(), length, 0), static_cast<ssize_t>(length));
    void* p = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, fd, 0);
    EXPECT_NE(p, MAP_FAILED);
    map = static_cast<const volatile char*>(p);
  }
  ~ShmFile() {
    ::munmap(const_cast<char*>(map), length);
    ::close(fd);
  }
  int fd = -1;
  size_t page = 0;
  size_t length = 0;
  const volatile char* map = nullptr;
};

TEST(SigbusGuardTest, AReadPastAShrunkFileReadsZerosAndFlagsTheRange) {
  ShmFile file(4);
  const int slot = SigbusGuard::Register(const_cast<char*>(file.map), file.length);
  ASSERT_GE(slot, 0);
  EXPECT_FALSE(SigbusGuard::Faulted(slot));
  EXPECT_EQ(file.map[3 * file.page], 'x');
  ASSERT_EQ(::ftruncate(file.fd, static_cast<off_t>(file.page)), 0);
  EXPECT_FALSE(SigbusGuard::Faulted(slot));   // nothing touched the lost pages yet
  EXPECT_EQ(file.map[3 * file.page + 5], 0);  // past the new end: SIGBUS without the guard
  EXPECT_TRUE(SigbusGuard::Faulted(slot));
  // The whole range reads zeros now, the page still inside the file too:
  // what a refit read from it can no longer be told apart, so all of it is
  // refused.
  EXPECT_EQ(file.map[0], 0);
  EXPECT_EQ(file.map[file.length - 1], 0);
  SigbusGuard::Unregister(slot);
}

TEST(SigbusGuardTest, AFaultOutsideEveryGuardedRangeStillKillsTheProcess) {
  ShmFile guarded(2);
  const int slot = SigbusGuard::Register(const_cast<char*>(guarded.map), guarded.length);
  ASSERT_GE(slot, 0);
  ShmFile unguarded(2);
  ASSERT_EQ(::ftruncate(unguarded.fd, 0), 0);
  EXPECT_EXIT(
      {
        volatile char c = unguarded.map[unguarded.page];
        (void)c;
        ::_exit(0);
      },
      // Killed by SIGBUS; under a sanitizer, its handler reports the fault
      // and exits non-zero instead.
      [](int status) {
        return (WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS) ||
               (WIFEXITED(status) && WEXITSTATUS(status) != 0);
      },
      "");
  EXPECT_FALSE(SigbusGuard::Faulted(slot));
  SigbusGuard::Unregister(slot);
}

// A SIGBUS that no load raised (sent with kill, or forged with an address
// inside a guarded range) patches nothing and ends the process, as without
// the guard; before, it was swallowed and switched the guard off for good.
TEST(SigbusGuardTest, ASentSigbusEndsTheProcessAndPatchesNothing) {
  ShmFile file(2);
  const int slot = SigbusGuard::Register(const_cast<char*>(file.map), file.length);
  ASSERT_GE(slot, 0);
  constexpr int kSurvived = 3;  // the child's exit status if the signal was swallowed
  auto ended_by_it = [](int status) {
    if (WIFSIGNALED(status)) return WTERMSIG(status) == SIGBUS;
    // Under a sanitizer, its handler reports the signal and exits non-zero.
    return WIFEXITED(status) && WEXITSTATUS(status) != 0 && WEXITSTATUS(status) != kSurvived;
  };
  EXPECT_EXIT(
      {
        ::kill(::getpid(), SIGBUS);
        ::_exit(kSurvived);
      },
      ended_by_it, "");
  EXPECT_EXIT(
      {
        siginfo_t forged{};
        forged.si_signo = SIGBUS;
        forged.si_code = SI_QUEUE;
        forged.si_addr = const_cast<char*>(file.map);
        ::syscall(SYS_rt_tgsigqueueinfo, ::getpid(), ::syscall(SYS_gettid), SIGBUS, &forged);
        ::_exit(kSurvived);
      },
      ended_by_it, "");
  // (The signals went to the death tests' children.) A real fault is still
  // patched here.
  EXPECT_FALSE(SigbusGuard::Faulted(slot));
  ASSERT_EQ(::ftruncate(file.fd, 0), 0);
  EXPECT_EQ(file.map[file.page], 0);
  EXPECT_TRUE(SigbusGuard::Faulted(slot));
  SigbusGuard::Unregister(slot);
}

TEST(SigbusGuardTest, SlotsAreReusedAndAFreshOneIsNotFaulted) {
  std::vector<int> slots;
  ShmFile file(1);
  for (int i = 0; i < SigbusGuard::kMaxRanges; ++i) {
    const int slot = SigbusGuard::Register(const_cast<char*>(file.map), file.length);
    if (slot < 0) break;
    slots.push_back(slot);
  }
  // Every slot taken: the caller is told to read another way.
  EXPECT_EQ(SigbusGuard::Register(const_cast<char*>(file.map), file.length), -1);
  EXPECT_GE(slots.size(), static_cast<size_t>(SigbusGuard::kMaxRanges) - 2);
  for (int slot : slots) SigbusGuard::Unregister(slot);
  const int again = SigbusGuard::Register(const_cast<char*>(file.map), file.length);
  EXPECT_GE(again, 0);
  EXPECT_FALSE(SigbusGuard::Faulted(again));
  EXPECT_EQ(file.map[0], 'x');
  SigbusGuard::Unregister(again);
}

}  // namespace
}  // namespace refit::server
