// Test directories without std::filesystem's recursive calls: libtorch.so
// exports copies of some std::filesystem functions, and a test binary bound
// to them can crash in remove_all (it calls through a null pointer while it
// recurses into a directory that exists).
#ifndef REFIT_TESTS_TESTING_TEMP_DIR_H_
#define REFIT_TESTS_TESTING_TEMP_DIR_H_

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>

namespace refit::testing {

// Removes `path` and everything under it (symlinks not followed); nothing
// when it does not exist.
inline void RemoveTree(const std::string& path) {
  ::nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, struct FTW*) { return std::remove(p); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

// mkdir -p: true once `path` is a directory.
inline bool MakeDirs(const std::string& path) {
  for (size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    const std::string prefix = path.substr(0, slash);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) return false;
    if (slash == std::string::npos) break;
  }
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace refit::testing

#endif  // REFIT_TESTS_TESTING_TEMP_DIR_H_
