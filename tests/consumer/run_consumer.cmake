# Builds and runs the consumer project against randattn, as a ctest case.
#
#   cmake -DMODE=install|subdirectory -DWORK_DIR=<scratch dir>
#         -DRANDATTN_SOURCE_DIR=<repo> -DRANDATTN_BINARY_DIR=<build tree>
#         [-DCONSUMER_GENERATOR=<gen>] [-DCONSUMER_CXX_COMPILER=<c++>] [-DCONSUMER_CONFIG=<cfg>]
#         -P run_consumer.cmake
#
# MODE=install:      cmake --install the build tree into WORK_DIR/prefix, then build tests/consumer
#                    with find_package(randattn) against that prefix only.
# MODE=subdirectory: build tests/consumer_subdir, which add_subdirectory()s the source tree.

foreach(var MODE WORK_DIR RANDATTN_SOURCE_DIR RANDATTN_BINARY_DIR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT CONSUMER_CONFIG)
  set(CONSUMER_CONFIG Release)
endif()

function(run_step description)
  message(STATUS "${description}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${description}: failed (${rc})")
  endif()
endfunction()

set(configure_args -DCMAKE_BUILD_TYPE=${CONSUMER_CONFIG} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
if(CONSUMER_GENERATOR)
  list(APPEND configure_args -G "${CONSUMER_GENERATOR}")
endif()
if(CONSUMER_CXX_COMPILER)
  list(APPEND configure_args -DCMAKE_CXX_COMPILER=${CONSUMER_CXX_COMPILER})
endif()

file(REMOVE_RECURSE "${WORK_DIR}")
set(build_dir "${WORK_DIR}/build")

if(MODE STREQUAL "install")
  set(prefix "${WORK_DIR}/prefix")
  run_step("install randattn into ${prefix}"
    ${CMAKE_COMMAND} --install "${RANDATTN_BINARY_DIR}" --prefix "${prefix}" --config ${CONSUMER_CONFIG})
  foreach(file
      include/randattn/randattn.hpp
      include/randattn/io/npy.hpp
      include/randattn/hashing/unit_rows.hpp
      include/randattn/hashing/detail/bucket_sort.hpp
      include/randattn/core/detail/score_tile.hpp
      include/randattn/lsh/detail/target_blocks.hpp
      include/randattn/sketch/detail/ordered_sum.hpp
      include/randattn/decode/detail/binary_io.hpp
      include/randattn/mpi/detail/reduce.hpp
      share/cmake/randattn/randattnConfig.cmake
      share/cmake/randattn/randattnConfigVersion.cmake
      share/cmake/randattn/randattnTargets.cmake
      share/cmake/randattn/FindRandom123.cmake)
    if(NOT EXISTS "${prefix}/${file}")
      message(FATAL_ERROR "installed tree lacks ${file}")
    endif()
  endforeach()
  run_step("configure tests/consumer"
    ${CMAKE_COMMAND} -S "${RANDATTN_SOURCE_DIR}/tests/consumer" -B "${build_dir}" ${configure_args}
    "-DCMAKE_PREFIX_PATH=${prefix}")
  # The package must come from the fresh install, not from some other randattn on the system.
  file(STRINGS "${build_dir}/CMakeCache.txt" dir_line REGEX "^randattn_DIR:")
  string(REGEX REPLACE "^randattn_DIR:[A-Z]+=" "" found_dir "${dir_line}")
  file(REAL_PATH "${found_dir}" found_dir)
  file(REAL_PATH "${prefix}" real_prefix)
  string(FIND "${found_dir}" "${real_prefix}/" pos)
  if(NOT pos EQUAL 0)
    message(FATAL_ERROR "randattn was found in '${found_dir}', not in the test prefix '${real_prefix}'")
  endif()
elseif(MODE STREQUAL "subdirectory")
  run_step("configure tests/consumer_subdir"
    ${CMAKE_COMMAND} -S "${RANDATTN_SOURCE_DIR}/tests/consumer_subdir" -B "${build_dir}" ${configure_args}
    "-DRANDATTN_REPO_DIR=${RANDATTN_SOURCE_DIR}")
else()
  message(FATAL_ERROR "run_consumer.cmake: unknown MODE '${MODE}' (install or subdirectory)")
endif()

run_step("build the consumer" ${CMAKE_COMMAND} --build "${build_dir}" --config ${CONSUMER_CONFIG})
run_step("run the consumer"
  ${CMAKE_CTEST_COMMAND} --test-dir "${build_dir}" -C ${CONSUMER_CONFIG} --output-on-failure --no-tests=error)
