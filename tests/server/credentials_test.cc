// JobCredentials (server/coordinator/credentials.h): which job a bearer token grants, from
// the admin file, the job tokens directory and minted tokens; reloads; durability of minted
// tokens across a coordinator restart on one store.
#include "server/coordinator/credentials.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "store/store.h"
#include "tests/testing/wait_for.h"

namespace collserve::server {
namespace {

using ::collserve::testing::WaitFor;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kAdmin[] = "admin-token-0123456789abcdef";
constexpr char kTrain[] = "train-token-0123456789abcdef";
constexpr char kEval[] = "eval-token-0123456789abcdef!";

std::string Bearer(absl::string_view token) { return absl::StrCat("Bearer ", token); }

class CredentialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/collserve-credentials-test.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    std::filesystem::create_directory(dir_ + "/jobs");
    Write("admin", kAdmin);
    Write("jobs/train", absl::StrCat(kTrain, "\n"));
    Write("jobs/eval", kEval);
    auto store = store::NewMemoryStore(store::StoreOptions{});
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void Write(const std::string& name, const std::string& content) {
    // Replace by rename, as a Kubernetes Secret update does.
    std::ofstream(dir_ + "/" + name + ".tmp") << content;
    std::filesystem::rename(dir_ + "/" + name + ".tmp", dir_ + "/" + name);
  }

  CredentialsOptions Options() {
    CredentialsOptions o;
    o.admin_token_file = dir_ + "/admin";
    o.job_tokens_dir = dir_ + "/jobs";
    o.refresh_interval = absl::Milliseconds(100);
    return o;
  }

  std::unique_ptr<JobCredentials> Make(const CredentialsOptions& o) {
    auto c = JobCredentials::Create(o, store_.get());
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  std::string dir_;
  std::unique_ptr<store::Store> store_;
};

TEST_F(CredentialsTest, AJobTokenGrantsItsJobOnlyAndTheAdminTokenEveryJob) {
  auto c = Make(Options());
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(*c->Authorize(Bearer(kTrain), "train"), Principal::kJob);
  EXPECT_EQ(*c->Authorize(Bearer(kEval), "eval"), Principal::kJob);
  EXPECT_EQ(*c->Authorize(Bearer(kAdmin), "train"), Principal::kAdmin);
  EXPECT_EQ(*c->Authorize(Bearer(kAdmin), ""), Principal::kAdmin);
  // The scheme is case-insensitive (RFC 7235 §2.1).
  EXPECT_EQ(*c->Authorize(absl::StrCat("bearer ", kTrain), "train"), Principal::kJob);

  absl::Status other = c->Authorize(Bearer(kTrain), "eval").status();
  EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied) << other;
  EXPECT_THAT(other.message(), HasSubstr("grants job \"train\", not job \"eval\""));
  EXPECT_EQ(c->Authorize(Bearer(kTrain), "").status().code(), absl::StatusCode::kPermissionDenied);

  absl::Status none = c->Authorize("", "train").status();
  EXPECT_EQ(none.code(), absl::StatusCode::kUnauthenticated) << none;
  EXPECT_THAT(none.message(), HasSubstr("COLLSERVE_TOKEN"));
  absl::Status unknown = c->Authorize(Bearer("not-a-token-of-anyone-here"), "train").status();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kUnauthenticated) << unknown;
  for (const std::string& malformed : {std::string("Basic dXNlcjpwYXNz"), std::string(kTrain), std::string("Bearer "),
                                       absl::StrCat("Bearer ", std::string(5000, 'x'))}) {
    EXPECT_EQ(c->Authorize(malformed, "train").status().code(), absl::StatusCode::kUnauthenticated) << malformed;
  }
  // No error names a token, however it was wrong.
  for (const absl::Status& s : {other, none, unknown}) {
    EXPECT_THAT(s.message(), Not(HasSubstr(kTrain)));
    EXPECT_THAT(s.message(), Not(HasSubstr(kAdmin)));
  }
  EXPECT_TRUE(c->AuthorizeAdmin(Bearer(kAdmin), "MintJobToken").ok());
  EXPECT_EQ(c->AuthorizeAdmin(Bearer(kTrain), "MintJobToken").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(c->AuthorizeAdmin("", "MintJobToken").code(), absl::StatusCode::kUnauthenticated);
}

TEST_F(CredentialsTest, WithoutATokenOnlyAnExplicitOptOutLetsCallsThrough) {
  CredentialsOptions o;
  auto refused = JobCredentials::Create(o, store_.get());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("--allow_unauthenticated"));
  o.allow_unauthenticated = true;
  auto open = Make(o);
  ASSERT_NE(open, nullptr);
  EXPECT_EQ(*open->Authorize("", "train"), Principal::kUnauthenticated);
  // A presented token is still checked.
  EXPECT_EQ(open->Authorize(Bearer("unknown-token-0123456789"), "train").status().code(),
            absl::StatusCode::kUnauthenticated);
  // With tokens configured too, a call with none still gets in, a wrong one does not.
  o = Options();
  o.allow_unauthenticated = true;
  auto both = Make(o);
  ASSERT_NE(both, nullptr);
  EXPECT_EQ(*both->Authorize("", "eval"), Principal::kUnauthenticated);
  EXPECT_EQ(both->Authorize(Bearer(kTrain), "eval").status().code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(CredentialsTest, BadTokenFilesAreRefusedAtStartNamingTheFileNotTheToken) {
  Write("jobs/short", "tooshort");
  auto c = JobCredentials::Create(Options(), store_.get());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr(dir_ + "/jobs/short"));
  EXPECT_THAT(c.status().message(), HasSubstr("at least 16"));
  EXPECT_THAT(c.status().message(), Not(HasSubstr("tooshort")));
  std::filesystem::remove(dir_ + "/jobs/short");
  CredentialsOptions missing = Options();
  missing.admin_token_file = dir_ + "/no-such-file";
  c = JobCredentials::Create(missing, store_.get());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("no-such-file"));
  // Names that are not job names, and Kubernetes' ..data links, are skipped.
  Write("jobs/..data", "whatever-0123456789abcdef");
  Write("jobs/not a job", "whatever-0123456789abcdef");
  EXPECT_NE(Make(Options()), nullptr);
}

TEST_F(CredentialsTest, RotatedAndRemovedTokenFilesTakeEffectWithoutARestart) {
  auto c = Make(Options());
  ASSERT_NE(c, nullptr);
  const std::string rotated = "train-token-rotated-0123456789";
  Write("jobs/train", rotated);
  std::filesystem::remove(dir_ + "/jobs/eval");
  EXPECT_TRUE(WaitFor([&] { return c->Authorize(Bearer(rotated), "train").ok(); }, absl::Seconds(20)));
  EXPECT_EQ(*c->Authorize(Bearer(rotated), "train"), Principal::kJob);
  EXPECT_EQ(c->Authorize(Bearer(kTrain), "train").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(c->Authorize(Bearer(kEval), "eval").status().code(), absl::StatusCode::kUnauthenticated);
  // A file that turns bad denies its job (never leaves it open) until it is fixed.
  Write("jobs/train", "short");
  EXPECT_FALSE(c->Reload().ok());
  EXPECT_FALSE(c->Authorize(Bearer(rotated), "train").ok());
  EXPECT_FALSE(c->Authorize(Bearer("short"), "train").ok());
  Write("jobs/train", rotated);
  EXPECT_TRUE(c->Reload().ok());
  EXPECT_TRUE(c->Authorize(Bearer(rotated), "train").ok());
}

TEST_F(CredentialsTest, MintedTokensGrantTheirJobSurviveARestartAndAreRevoked) {
  auto c = Make(Options());
  ASSERT_NE(c, nullptr);
  auto first = c->Mint("new-job");
  auto second = c->Mint("new-job");
  auto other = c->Mint("other");
  ASSERT_TRUE(first.ok() && second.ok() && other.ok());
  EXPECT_NE(*first, *second);
  EXPECT_THAT(*first, ::testing::StartsWith("csj_"));
  EXPECT_GE(first->size(), 40u);  // 256 random bits
  EXPECT_EQ(*c->Authorize(Bearer(*first), "new-job"), Principal::kJob);
  EXPECT_EQ(*c->Authorize(Bearer(*second), "new-job"), Principal::kJob);
  EXPECT_EQ(c->Authorize(Bearer(*other), "new-job").status().code(), absl::StatusCode::kPermissionDenied);
  // The store holds digests only, never a token.
  auto kept = store_->Get("#auth/minted", absl::ZeroDuration());
  ASSERT_TRUE(kept.ok());
  EXPECT_THAT(*kept, Not(HasSubstr(*first)));
  EXPECT_THAT(*kept, HasSubstr("new-job "));
  // A coordinator started again on the same store knows them.
  c.reset();
  c = Make(Options());
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(*c->Authorize(Bearer(*first), "new-job"), Principal::kJob);
  EXPECT_EQ(*c->Revoke("new-job"), 2);
  EXPECT_EQ(*c->Revoke("new-job"), 0);
  EXPECT_EQ(c->Authorize(Bearer(*first), "new-job").status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(*c->Authorize(Bearer(*other), "other"), Principal::kJob);
  c.reset();
  c = Make(Options());
  ASSERT_NE(c, nullptr);
  EXPECT_FALSE(c->Authorize(Bearer(*second), "new-job").ok());
  EXPECT_TRUE(c->Authorize(Bearer(*other), "other").ok());
}

// Coordinator replicas share one store (etcd): a token minted or revoked through one
// reaches the other within the refresh interval (100 ms here), and a revoke through one
// does not drop a token minted through the other meanwhile.
TEST_F(CredentialsTest, MintedTokensReachAnotherCoordinatorOnTheSameStore) {
  auto a = Make(Options());
  auto b = Make(Options());
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto token = a->Mint("shared-job");
  ASSERT_TRUE(token.ok());
  auto granted = [&](JobCredentials& c, const std::string& t) { return c.Authorize(Bearer(t), "shared-job").ok(); };
  EXPECT_TRUE(WaitFor([&] { return granted(*b, *token); }, absl::Seconds(10)))
      << "a token minted through one coordinator never reached the other";
  auto other = b->Mint("other-job");
  ASSERT_TRUE(other.ok());
  auto revoked = b->Revoke("shared-job");
  ASSERT_TRUE(revoked.ok()) << revoked.status();
  EXPECT_EQ(*revoked, 1);
  EXPECT_TRUE(WaitFor([&] { return !granted(*a, *token); }, absl::Seconds(10)))
      << "a token revoked through one coordinator still works at the other";
  EXPECT_TRUE(WaitFor([&] { return a->Authorize(Bearer(*other), "other-job").ok(); }, absl::Seconds(10)));
}

}  // namespace
}  // namespace collserve::server
