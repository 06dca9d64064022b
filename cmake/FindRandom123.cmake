# FindRandom123
# -------------
# Locates the header-only Random123 library (counter-based random number generators).
#
# Result variables:
#   Random123_FOUND         true when Random123/philox.h was found
#   Random123_INCLUDE_DIRS  directory containing the Random123/ header folder
#
# Imported target:
#   Random123::Random123    INTERFACE target carrying the include directory
#
# Hints: set Random123_ROOT (CMake variable or environment variable) or
# Random123_INCLUDE_DIR to point at a non-standard installation.

find_path(Random123_INCLUDE_DIR
  NAMES Random123/philox.h
  DOC "Directory containing Random123/philox.h")
mark_as_advanced(Random123_INCLUDE_DIR)

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Random123
  REQUIRED_VARS Random123_INCLUDE_DIR)

if(Random123_FOUND)
  set(Random123_INCLUDE_DIRS "${Random123_INCLUDE_DIR}")
  if(NOT TARGET Random123::Random123)
    add_library(Random123::Random123 INTERFACE IMPORTED)
    set_target_properties(Random123::Random123 PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${Random123_INCLUDE_DIR}")
  endif()
endif()
