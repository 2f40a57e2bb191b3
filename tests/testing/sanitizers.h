// Whether this test binary is built with a sanitizer, for tests that scale their work to it.
//
// A sanitized build runs the same paths several times slower (TSan: 5-15x on the large
// copies of the sweeps, most of it page faults on its shadow memory), so tests whose point
// under a sanitizer is the threads and not the volume of bytes run smaller sizes there
// (UnderTsan), keeping every code path they cover (docs/testing.md "Sanitizers").
// GCC defines __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__; clang, which builds the ASan tree,
// has __has_feature.
#ifndef COLLSERVE_TESTS_TESTING_SANITIZERS_H_
#define COLLSERVE_TESTS_TESTING_SANITIZERS_H_

#if defined(__SANITIZE_THREAD__)
#define COLLSERVE_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define COLLSERVE_TEST_TSAN 1
#endif
#endif

#if defined(__SANITIZE_ADDRESS__) || defined(COLLSERVE_TEST_TSAN)
#define COLLSERVE_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COLLSERVE_TEST_SANITIZED 1
#endif
#endif

namespace collserve::testing {

#ifdef COLLSERVE_TEST_SANITIZED
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

#ifdef COLLSERVE_TEST_TSAN
inline constexpr bool kThreadSanitized = true;
#else
inline constexpr bool kThreadSanitized = false;
#endif

// `release` in an unsanitized or ASan build, `tsan` under ThreadSanitizer.
template <typename T>
constexpr T UnderTsan(T release, T tsan) {
  return kThreadSanitized ? tsan : release;
}

// `release` in an unsanitized build, `sanitized` under ASan or TSan.
template <typename T>
constexpr T UnderSanitizer(T release, T sanitized) {
  return kSanitized ? sanitized : release;
}

// The coordinator's --lease_grace for a test that does not measure leases; Cluster starts
// every coordinator with it. Under a sanitizer beside other test steps a sidecar renewed its
// lease on a group past the default 3 s (a stall of the loaded 2-core CI machine): the
// coordinator took its host as lost and ended the generation, and the ranks' calls failed
// with "generation G ... is over" (in SdkCompletionTest, the TLS job, and DesyncTest, whose
// init failed so). 20 s there; the default elsewhere.
inline constexpr const char* kLeaseGraceFlag = UnderSanitizer("--lease_grace=3s", "--lease_grace=20s");

// The coordinator's default --lease_grace, for a test that measures how soon a lost host is
// taken as lost: a later flag wins, so this after Cluster's kLeaseGraceFlag restores it.
inline constexpr const char* kMeasuredLeaseGraceFlag = "--lease_grace=3s";

}  // namespace collserve::testing

#endif  // COLLSERVE_TESTS_TESTING_SANITIZERS_H_
