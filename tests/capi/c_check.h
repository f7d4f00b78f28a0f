/* The plain-C tests' checks (the .c programs in tests/capi): CHECK counts a failed
 * condition and goes on; OK stops the current test function (returns -1)
 * when a call fails, printing the engine's (or the thread's) message;
 * check_summary ends main. One translation unit per program. */
#ifndef STRATA_TESTS_CAPI_C_CHECK_H
#define STRATA_TESTS_CAPI_C_CHECK_H

#include <stdio.h>

#include "strata/strata.h"

static int failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                              \
    }                                                                          \
  } while (0)

#define OK(e, call)                                                                                    \
  do {                                                                                                 \
    strata_status_t rc_ = (call);                                                                      \
    if (rc_ != STRATA_OK) {                                                                            \
      fprintf(stderr, "%s:%d: %s -> %s: %s\n", __FILE__, __LINE__, #call, strata_status_string(rc_), \
              (e) ? strata_engine_last_error(e) : strata_last_error());                              \
      ++failures;                                                                                      \
      return -1;                                                                                       \
    }                                                                                                  \
  } while (0)

/* main's exit status: 0 when every check passed, else 1 (with the count). */
static int check_summary(const char* what) {
  if (failures) {
    fprintf(stderr, "%s: %d check(s) failed\n", what, failures);
    return 1;
  }
  printf("%s: all checks passed\n", what);
  return 0;
}

#endif
