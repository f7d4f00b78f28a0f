/*
 * strata.h: the C ABI of Strata, the contract for trainers that link it.
 *
 * Conventions (they hold for every function below):
 *  - Every call that can fail returns strata_status_t; STRATA_OK is 0. Outputs
 *    are the last pointer arguments and are written only on success.
 *  - strata_status_string() names a status; the text of the most recent error
 *    (what failed, where, why) is available per handle where there is one, and
 *    per thread from strata_last_error() for calls without a handle.
 *  - Config structs start with their size (set it to sizeof(the struct)), so
 *    fields can be appended in later versions without breaking callers built
 *    against this header. Zero-initialise and set what you need: every field
 *    documents the meaning of 0.
 *  - No C++ types cross this boundary; the library exports only strata_*.
 *  - Nothing aborts on bad input: invalid arguments return
 *    STRATA_ERR_INVALID_ARGUMENT with a message.
 */
#ifndef STRATA_STRATA_H_
#define STRATA_STRATA_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define STRATA_API
#else
#define STRATA_API __attribute__((visibility("default")))
#endif

#define STRATA_API_VERSION 1

/* ------------------------------------------------------------------ status */

typedef enum strata_status {
  STRATA_OK = 0,
  STRATA_ERR_INVALID_ARGUMENT = 1, /* bad input from the caller or a config file */
  STRATA_ERR_IO = 2,               /* an I/O call failed (EIO, EBADF, ...) */
  STRATA_ERR_NO_SPACE = 3,         /* disk full */
  STRATA_ERR_OUT_OF_BUDGET = 4,    /* a configured memory budget would be exceeded */
  STRATA_ERR_OUT_OF_MEMORY = 5,    /* the system refused memory */
  STRATA_ERR_NOT_FOUND = 6,
  STRATA_ERR_PERMISSION = 7,
  STRATA_ERR_UNAVAILABLE = 8, /* a feature is missing here (no GPU, io_uring disabled, ISA absent) */
  STRATA_ERR_CORRUPT = 9,     /* data failed a check (checksum, bounds) */
  STRATA_ERR_ALREADY_EXISTS = 10,
  STRATA_ERR_CANCELLED = 11,
  STRATA_ERR_INTERNAL = 12 /* a bug in Strata: please report it with the message */
} strata_status_t;

/* "STRATA_OK", "STRATA_ERR_IO", ...; never NULL. Thread-safe. */
STRATA_API const char* strata_status_string(strata_status_t status);

/* The message of the last failed call on this thread that has no handle
 * ("" if none). Valid until the next failing call on this thread. */
STRATA_API const char* strata_last_error(void);

/* "0.1.0 (commit ..., RelWithDebInfo)". Static storage; thread-safe. */
STRATA_API const char* strata_version(void);

/* The API version this library implements (STRATA_API_VERSION it was built with). */
STRATA_API int strata_api_version(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* STRATA_STRATA_H_ */
