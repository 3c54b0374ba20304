// Whether this test binary was built with AddressSanitizer or
// ThreadSanitizer (scripts/sanitize.sh), for tests whose subject the
// sanitizers' runtimes change: crash reports (they install their own
// handlers) and running out of descriptors (they need descriptors of their
// own; UBSan's type checks then report objects falsely).
#ifndef REFIT_TESTS_TESTING_SANITIZERS_H_
#define REFIT_TESTS_TESTING_SANITIZERS_H_

namespace refit::testing {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define REFIT_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define REFIT_TEST_SANITIZED 1
#endif
#endif

#ifdef REFIT_TEST_SANITIZED
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

}  // namespace refit::testing

#endif  // REFIT_TESTS_TESTING_SANITIZERS_H_
