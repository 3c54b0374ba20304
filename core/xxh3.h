// XXH3, through libxxhash's run-time dispatch where the library has it: the
// AVX2 / AVX-512 loops on CPUs that have them, the same hashes as the SSE2
// default (about 1.7x its speed from memory and 4x from cache on an AVX-512
// x86-64). CMake defines REFIT_XXH3_DISPATCH when the library exports the
// dispatching entry points; the XXH3_* names then resolve to them.
#ifndef REFIT_CORE_XXH3_H_
#define REFIT_CORE_XXH3_H_

#ifdef REFIT_XXH3_DISPATCH
#include <xxh_x86dispatch.h>  // IWYU pragma: export
#else
#include <xxhash.h>  // IWYU pragma: export
#endif

#endif  // REFIT_CORE_XXH3_H_
