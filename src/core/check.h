#pragma once
// Internal invariants only (never user input): abort with a located message.
#include <cstdio>
#include <cstdlib>

#define M3_CHECK(cond, ...)                                                         \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "m3 internal check failed at %s:%d: %s\n", __FILE__,     \
                   __LINE__, #cond);                                                \
      std::fprintf(stderr, "  " __VA_ARGS__);                                       \
      std::fprintf(stderr, "\n");                                                   \
      std::abort();                                                                 \
    }                                                                               \
  } while (0)
