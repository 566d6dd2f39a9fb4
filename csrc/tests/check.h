// A minimal test harness for the native tests: CHECK records a failure and carries on.
#pragma once

#include <cstdio>

namespace gradsync_test {
inline int& failures() {
  static int n = 0;
  return n;
}
inline int finish(const char* name) {
  std::printf("%s: %s (%d failed checks)\n", name, failures() ? "FAILED" : "passed", failures());
  return failures() ? 1 : 0;
}
}  // namespace gradsync_test

#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      if (++gradsync_test::failures() <= 20) {                             \
        std::printf("%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
        std::printf(__VA_ARGS__);                                          \
        std::printf("\n");                                                 \
      }                                                                    \
    }                                                                      \
  } while (0)
