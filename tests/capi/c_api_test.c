/* The C API used from plain C (C11): compiles without a C++ compiler's help
 * and checks status strings, version and error reporting. Prints TAP-like
 * lines; exit status 0 = pass. */
#include <stdio.h>
#include <string.h>

#include "strata/strata.h"

static int failures = 0;
#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                     \
    }                                                                 \
  } while (0)

int main(void) {
  CHECK(strata_api_version() == STRATA_API_VERSION);
  CHECK(strcmp(strata_status_string(STRATA_OK), "STRATA_OK") == 0);
  CHECK(strcmp(strata_status_string(STRATA_ERR_NO_SPACE), "STRATA_ERR_NO_SPACE") == 0);
  CHECK(strcmp(strata_status_string((strata_status_t)999), "STRATA_ERR_UNKNOWN") == 0);
  CHECK(strlen(strata_version()) > 0);
  CHECK(strata_last_error() != NULL);
  if (failures) return 1;
  printf("c api: all checks passed\n");
  return 0;
}
