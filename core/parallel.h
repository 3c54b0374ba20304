// Work spread over the process' helper threads: the ones the FP8 quantizer
// keeps between calls (started on first use, never more than a call asks
// for). Other bulk work of a refit (the commit's copy) uses them too.
#ifndef REFIT_CORE_PARALLEL_H_
#define REFIT_CORE_PARALLEL_H_

#include <functional>

namespace refit::core {

// Runs task(i) for every i in [0, n) on the calling thread and up to n - 1
// helpers, and returns once every task has run. One call at a time uses the
// helpers; a call that finds them taken starts threads of its own.
void RunInParallel(int n, const std::function<void(int)>& task);

// Runs task(i) for every i in [0, n), each exactly once, on the calling
// thread and up to `threads` - 1 helpers, each taking the next i as it
// finishes one: for tasks of uneven sizes (put the largest first).
void ForEachInParallel(int n, int threads, const std::function<void(int)>& task);

// Threads for memory-bound bulk work (a commit's copy, hashing a layer): the
// machine's cores, at most 8. A few saturate most servers' memory bandwidth;
// one alone gets a fraction of it.
int BulkThreads();

}  // namespace refit::core

#endif  // REFIT_CORE_PARALLEL_H_
