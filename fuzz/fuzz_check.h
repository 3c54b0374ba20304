// FUZZ_CHECK: the fuzz targets' invariant check. It aborts with the
// condition and line, which libFuzzer records as a crash (and saves the
// input) and which fails the corpus replay under ctest. Unlike assert() it
// is never compiled out.
#ifndef REFIT_FUZZ_FUZZ_CHECK_H_
#define REFIT_FUZZ_FUZZ_CHECK_H_

#include <cstdio>
#include <cstdlib>

#define FUZZ_CHECK(cond)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)

#endif  // REFIT_FUZZ_FUZZ_CHECK_H_
