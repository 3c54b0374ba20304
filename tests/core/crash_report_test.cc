// Every test binary reports a crash with a symbolized stack trace
// (tests/testing/test_main.cc), so a test that dies of a signal once on a CI
// machine leaves more than "SEGFAULT" in the log.
#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "tests/testing/sanitizers.h"

namespace {

// Not inlined, so it is a frame of its own in the trace.
[[gnu::noinline]] void CrashHereOnPurpose() {
  ::raise(SIGSEGV);
  ::_exit(0);
}

TEST(CrashReportTest, ATestThatDiesOfASignalPrintsWhereItDied) {
  if (refit::testing::kSanitized) {
    GTEST_SKIP() << "under a sanitizer, its own handler reports crashes";
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The signal's name, then the frames, this function's among them, and the
  // process still ends by the signal.
  EXPECT_EXIT(CrashHereOnPurpose(), ::testing::KilledBySignal(SIGSEGV),
              "received SIGSEGV(.|\n)*CrashHereOnPurpose");
}

#if defined(__x86_64__)
[[gnu::noinline]] void CallThroughANullPointer(void (*volatile f)()) {
  f();
  ::_exit(0);
}

TEST(CrashReportTest, ACallThroughANullFunctionPointerNamesItsCaller) {
  // Nothing past the signal frame unwinds from pc 0; the return address
  // the call left on the stack names the caller.
  if (refit::testing::kSanitized) {
    GTEST_SKIP() << "under a sanitizer, its own handler reports crashes";
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(CallThroughANullPointer(nullptr), ::testing::KilledBySignal(SIGSEGV),
              "crashed at pc 0x0,(.|\n)*CallThroughANullPointer");
}
#endif

}  // namespace
