// The sidecar's engine metrics (server/sidecar/metrics_observer.h): the straggler and skew
// series are per group ({collserve_job, group}) and go when the group ends.
#include "server/sidecar/metrics_observer.h"

#include <gtest/gtest.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <string>

namespace collserve::server {
namespace {

std::string Scrape(prometheus::Registry& registry) {
  return prometheus::TextSerializer().Serialize(registry.Collect());
}

TEST(PrometheusObserverTest, StragglerAndSkewSeriesArePerGroupAndGoWhenTheGroupEnds) {
  prometheus::Registry registry;
  PrometheusObserver observer(registry);
  EXPECT_EQ(Scrape(registry).find("collserve_straggler_collectives_total{"), std::string::npos)
      << "no series before any group's collective";
  observer.OnArrivalSkew("a", "g1", absl::Milliseconds(300));
  observer.OnStraggler("a", "g1");
  observer.OnStraggler("a", "g1");
  observer.OnStraggler("b", "g2");
  std::string text = Scrape(registry);
  EXPECT_NE(text.find("collserve_straggler_collectives_total{collserve_job=\"a\",group=\"g1\"} 2"), std::string::npos)
      << text;
  EXPECT_NE(text.find("collserve_straggler_collectives_total{collserve_job=\"b\",group=\"g2\"} 1"), std::string::npos)
      << text;
  EXPECT_NE(text.find("collserve_collective_arrival_skew_seconds_count{collserve_job=\"a\",group=\"g1\"} 1"),
            std::string::npos)
      << text;
  observer.OnGroupEnded("a", "g1");
  observer.OnGroupEnded("c", "never-seen");  // nothing to remove: no effect
  text = Scrape(registry);
  EXPECT_EQ(text.find("group=\"g1\""), std::string::npos) << text;
  EXPECT_NE(text.find("collserve_straggler_collectives_total{collserve_job=\"b\",group=\"g2\"} 1"), std::string::npos)
      << text;
  observer.OnStraggler("a", "g1");  // a later group of the same name starts afresh
  EXPECT_NE(Scrape(registry).find("collserve_straggler_collectives_total{collserve_job=\"a\",group=\"g1\"} 1"),
            std::string::npos);
}

}  // namespace
}  // namespace collserve::server
