# Tri-state options (AUTO/ON/OFF) for optional dependencies.
#
#   strata_tristate(STRATA_URING "io_uring backend (liburing)" AUTO)
#
# After probing, call strata_feature_result(STRATA_URING FOUND "hint") which
# sets STRATA_HAVE_URING to 0/1 and records a line for the feature summary.
# ON but not found is a configure error naming what to install; AUTO without
# the dependency builds without it and says so.

set(STRATA_FEATURE_LINES "" CACHE INTERNAL "")

function(strata_tristate name doc default)
  set(${name} ${default} CACHE STRING "${doc} (AUTO/ON/OFF)")
  set_property(CACHE ${name} PROPERTY STRINGS AUTO ON OFF)
  string(TOUPPER "${${name}}" _v)
  if(NOT _v MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "${name}=${${name}}: expected AUTO, ON or OFF")
  endif()
  set(${name} ${_v} PARENT_SCOPE)
endfunction()

# strata_feature_result(<option> <found-bool> <what-to-install> [<detail>])
function(strata_feature_result name found install_hint)
  string(REPLACE "STRATA_" "STRATA_HAVE_" have ${name})
  set(detail "${ARGN}")
  if(${name} STREQUAL "OFF")
    set(${have} 0 PARENT_SCOPE)
    set(line "  [-] ${name}: off (${name}=OFF)")
  elseif(found)
    set(${have} 1 PARENT_SCOPE)
    set(line "  [x] ${name}: yes ${detail}")
  elseif(${name} STREQUAL "ON")
    message(FATAL_ERROR "${name}=ON but it is not available: ${install_hint}")
  else()
    set(${have} 0 PARENT_SCOPE)
    set(line "  [ ] ${name}: no (AUTO, to enable: ${install_hint})")
  endif()
  set(STRATA_FEATURE_LINES "${STRATA_FEATURE_LINES};${line}" CACHE INTERNAL "")
endfunction()

function(strata_print_feature_summary)
  message(STATUS "")
  message(STATUS "Strata ${PROJECT_VERSION} feature summary:")
  foreach(line IN LISTS STRATA_FEATURE_LINES)
    if(line)
      message(STATUS "${line}")
    endif()
  endforeach()
  message(STATUS "")
endfunction()
