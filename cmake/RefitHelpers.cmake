# Small helpers shared by every component.

# Warnings as errors on our own targets only.
function(refit_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror -Wno-unused-parameter>)
endfunction()

# Our binaries run without LD_LIBRARY_PATH: RPATH to the wheel's libraries.
function(refit_rpath target)
  set_target_properties(${target} PROPERTIES
    BUILD_RPATH "${REFIT_TORCH_LIB_DIR}"
    INSTALL_RPATH "${REFIT_TORCH_LIB_DIR}")
endfunction()

# One gtest executable per *_test.cc file; ctest discovers its cases.
# refit_add_tests(DIR <dir> LIBS <libs...> [LABELS <labels...>])
function(refit_add_tests)
  cmake_parse_arguments(ARG "" "DIR" "LIBS;LABELS" ${ARGN})
  file(GLOB _tests CONFIGURE_DEPENDS ${ARG_DIR}/*_test.cc)
  foreach(src ${_tests})
    get_filename_component(name ${src} NAME_WE)
    get_filename_component(dir ${ARG_DIR} NAME)
    set(target ${dir}_${name})
    add_executable(${target} ${src})
    target_link_libraries(${target} PRIVATE ${ARG_LIBS} refit_test_main GTest::gtest GTest::gmock)
    target_include_directories(${target} PRIVATE ${CMAKE_SOURCE_DIR})
    set_target_properties(${target} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
    refit_warnings(${target})
    refit_rpath(${target})
    set(_labels ${dir} ${ARG_LABELS})
    if(name MATCHES "_gpu_test$")
      list(APPEND _labels gpu)
    endif()
    # Labels are applied after discovery: a list passed through
    # gtest_discover_tests' PROPERTIES keeps only its first element.
    gtest_discover_tests(${target}
      WORKING_DIRECTORY ${CMAKE_SOURCE_DIR}
      TEST_LIST ${target}_TESTS
      PROPERTIES ENVIRONMENT "REFIT_BUILD_DIR=${CMAKE_BINARY_DIR}"
      DISCOVERY_TIMEOUT 60)
    set(_labels_file ${CMAKE_CURRENT_BINARY_DIR}/${target}_labels.cmake)
    file(WRITE ${_labels_file}
      "if(${target}_TESTS)\n  set_tests_properties(\${${target}_TESTS} PROPERTIES LABELS \"${_labels}\")\nendif()\n")
    set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${_labels_file})
  endforeach()
endfunction()
