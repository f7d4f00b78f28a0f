# Writes OUT (generated/strata/git_commit.h): the commit this build is made
# from, "-dirty" when tracked files differ from it, "unknown" outside a git
# checkout. Run at every build (the strata_git_commit target); the file is
# rewritten only when its text changes, so a build at the same commit
# recompiles nothing and a new commit recompiles only the two files that
# report it (tools/version.cpp, src/capi/c_api.cpp).
# Only SRC's own checkout counts: a source tree unpacked inside another
# repository (a tarball in someone's project) must not report that one's.
execute_process(COMMAND git rev-parse --show-toplevel
  WORKING_DIRECTORY ${SRC} OUTPUT_VARIABLE top OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
file(REAL_PATH "${SRC}" src_real)
if(top)
  file(REAL_PATH "${top}" top)
endif()
execute_process(COMMAND git rev-parse --short=12 HEAD
  WORKING_DIRECTORY ${SRC} OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE rc ERROR_QUIET)
if(NOT rc EQUAL 0 OR NOT commit OR NOT top STREQUAL src_real)
  set(commit "unknown")
else()
  execute_process(COMMAND git status --porcelain --untracked-files=no
    WORKING_DIRECTORY ${SRC} OUTPUT_VARIABLE changes OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(changes)
    string(APPEND commit "-dirty")
  endif()
endif()
set(text "// Generated at build time by cmake/git_commit.cmake: the commit this build is made from.
#pragma once

#include \"strata/strata_config.h\"

#define STRATA_GIT_COMMIT \"${commit}\"
// \"0.1.0 (commit abc123def456, RelWithDebInfo)\"
#define STRATA_VERSION_STRING STRATA_VERSION \" (commit \" STRATA_GIT_COMMIT \", \" STRATA_BUILD_TYPE \")\"
")
set(old "")
if(EXISTS ${OUT})
  file(READ ${OUT} old)
endif()
if(NOT old STREQUAL text)
  file(WRITE ${OUT} "${text}")
endif()
