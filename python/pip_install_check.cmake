# ctest script: `pip install --no-build-isolation SOURCE_DIR` into a virtual environment made
# with --system-site-packages (NumPy and pybind11 come from the system), then imports the
# installed package from outside the source tree and runs one attention call.
#   cmake -DPYTHON=... -DSOURCE_DIR=... -DWORK_DIR=... [-DLAUNCHER=ccache] [-DCMAKE_BUILD_DIR=...]
#         [-DGENERATOR=Ninja] [-DDEV_OPTIMIZATION=-O2] -P pip_install_check.cmake

foreach(var PYTHON SOURCE_DIR WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "pip_install_check.cmake: -D${var}=... is required")
  endif()
endforeach()

function(run)
  execute_process(COMMAND ${ARGN} WORKING_DIRECTORY "${WORK_DIR}" RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "failed (${rc}): ${cmd}")
  endif()
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(venv "${WORK_DIR}/venv")
run("${PYTHON}" -m venv --system-site-packages "${venv}")

# Two compile jobs at most; the compiler launcher (ccache) of the enclosing build, if any.
set(ENV{CMAKE_BUILD_PARALLEL_LEVEL} 2)
if(LAUNCHER)
  set(ENV{CMAKE_CXX_COMPILER_LAUNCHER} "${LAUNCHER}")
endif()
if(CMAKE_BUILD_DIR)
  set(ENV{RANDATTN_CMAKE_BUILD_DIR} "${CMAKE_BUILD_DIR}")
endif()
if(GENERATOR)
  set(ENV{CMAKE_GENERATOR} "${GENERATOR}")  # read by the cmake that setup.py runs
endif()
if(DEV_OPTIMIZATION)  # the enclosing build's level, so the compiler cache has the method table
  set(ENV{RANDATTN_CMAKE_ARGS} "-DRANDATTN_DEV_OPTIMIZATION=${DEV_OPTIMIZATION}")
endif()
set(ENV{PIP_DISABLE_PIP_VERSION_CHECK} 1)
run("${venv}/bin/python" -m pip install --no-build-isolation --no-index --no-deps "${SOURCE_DIR}")

# From WORK_DIR, so the import finds the installed package and not the sources.
run("${venv}/bin/python" -c "
import numpy as np, randattn, sys
assert randattn.__file__.startswith(sys.prefix), randattn.__file__
q = np.ones((4, 3)); out = randattn.attention(q, q, q, method='favor', features=8)
assert out.shape == (4, 3) and np.allclose(out, 1.0)
print('installed randattn', randattn.__version__, 'at', randattn.__file__)
")
