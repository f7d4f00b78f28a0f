# Install rules: what `cmake --install build --prefix P` puts where.
#   P/lib/libstrata.so*                 the C ABI (exported target Strata::strata)
#   P/include/strata/strata.h, .hpp     its headers
#   P/lib/strata/libstrata_cuda*.so     the run-time loaded CUDA modules (found next
#                                       to libstrata.so's directory, see
#                                       src/device/cuda_loader.cpp)
#   P/bin/strata                        the command line
#   P/lib/cmake/Strata/                 StrataConfig.cmake, version, targets
#   P/lib/pkgconfig/strata.pc           pkg-config
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set_target_properties(libstrata PROPERTIES EXPORT_NAME strata)
target_include_directories(libstrata PUBLIC $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
install(TARGETS libstrata EXPORT StrataTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(FILES ${PROJECT_SOURCE_DIR}/include/strata/strata.h ${PROJECT_SOURCE_DIR}/include/strata/strata.hpp
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/strata)
install(TARGETS strata RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
foreach(_module strata_cuda strata_cuda_train strata_nccl)
  if(TARGET ${_module})
    install(TARGETS ${_module} LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}/strata)
  endif()
endforeach()

install(EXPORT StrataTargets NAMESPACE Strata:: FILE StrataTargets.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Strata)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/StrataConfig.cmake.in
  ${PROJECT_BINARY_DIR}/StrataConfig.cmake INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Strata)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/StrataConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/StrataConfig.cmake ${PROJECT_BINARY_DIR}/StrataConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Strata)
# pkg-config: the prefix is the one given at install time (CMAKE_INSTALL_PREFIX
# is substituted when the file is installed, not when it is configured).
install(CODE "
  set(CMAKE_INSTALL_PREFIX \"\${CMAKE_INSTALL_PREFIX}\")
  set(CMAKE_INSTALL_LIBDIR \"${CMAKE_INSTALL_LIBDIR}\")
  set(CMAKE_INSTALL_INCLUDEDIR \"${CMAKE_INSTALL_INCLUDEDIR}\")
  set(PROJECT_VERSION \"${PROJECT_VERSION}\")
  configure_file(\"${PROJECT_SOURCE_DIR}/cmake/strata.pc.in\" \"${PROJECT_BINARY_DIR}/strata.pc.install\" @ONLY)
  file(INSTALL \"${PROJECT_BINARY_DIR}/strata.pc.install\" DESTINATION \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_LIBDIR}/pkgconfig\"
       RENAME strata.pc)
")
