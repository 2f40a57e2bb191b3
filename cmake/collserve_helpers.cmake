# The environment of every test: Abseil's Mutex deadlock detection aborts in each process a
# test starts (the daemons and the SDK switch it off by default: common/mutex_mode.h), so that
# a lock-order inversion fails the suite.
set(COLLSERVE_TEST_ENVIRONMENT "COLLSERVE_MUTEX_DEADLOCK_DETECTION=abort")

# collserve_cc_test(name SRCS ... DEPS ... [LABELS ...] [TIMEOUT s])
# One gtest binary, its tests discovered into ctest. Every test carries a ctest
# TIMEOUT so a hang fails the run instead of stalling CI, and COLLSERVE_TEST_ENVIRONMENT.
function(collserve_cc_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  add_executable(${name} ${ARG_SRCS})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gmock GTest::gtest_main)
  gtest_discover_tests(${name}
    DISCOVERY_TIMEOUT 30
    PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT} ENVIRONMENT "${COLLSERVE_TEST_ENVIRONMENT}")
endfunction()
