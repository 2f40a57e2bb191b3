// The sidecar's engine metrics (server/sidecar/metrics_observer.h): the straggler and skew
// series are per group ({collserve_job, group}) and go when the group ends; the scraped
// gauges (server/common/metrics.h) give one family per name.
#include "server/sidecar/metrics_observer.h"

#include <gtest/gtest.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/common/metrics.h"

namespace collserve::server {
namespace {

std::string Scrape(prometheus::Registry& registry) {
  return prometheus::TextSerializer().Serialize(registry.Collect());
}

// Series of one name that come apart in the list (per job, per class: each job's several
// names in turn) are one family: one HELP line each, as the text format requires.
TEST(ScrapeGaugesTest, SeriesOfOneNameAreOneFamilyWhereverTheyCome) {
  ScrapeGauges gauges([] {
    std::vector<GaugeValue> v;
    for (const char* cls : {"latency_critical", "bulk"}) {
      v.push_back(GaugeValue{"collserve_x_total", "X.", 1, /*counter=*/true, {{"priority_class", cls}}});
      v.push_back(GaugeValue{"collserve_y_seconds_total", "Y.", 2, /*counter=*/true, {{"priority_class", cls}}});
    }
    return v;
  });
  const std::string text = prometheus::TextSerializer().Serialize(gauges.Collect());
  const auto count = [&](const std::string& needle) {
    size_t n = 0;
    for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("# HELP collserve_x_total"), 1u) << text;
  EXPECT_EQ(count("# HELP collserve_y_seconds_total"), 1u) << text;
  EXPECT_EQ(count("collserve_x_total{priority_class="), 2u) << text;
  EXPECT_NE(text.find("collserve_y_seconds_total{priority_class=\"bulk\"} 2"), std::string::npos) << text;
  EXPECT_LT(text.find("collserve_x_total"), text.find("collserve_y_seconds_total")) << text;  // first-come order
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

// Backend errors are counted per peer host for the first 256 peers seen; later peers (a
// failing peer restarted again and again: its default host id holds its pid) count under
// "other" instead of adding series for good.
TEST(PrometheusObserverTest, BackendErrorSeriesAreBoundedInPeers) {
  prometheus::Registry registry;
  PrometheusObserver observer(registry);
  for (int i = 0; i < 300; ++i) observer.OnBackendError(absl::StrCat("host/", i));
  observer.OnBackendError("host/0");
  const std::string text = Scrape(registry);
  EXPECT_NE(text.find("collserve_backend_errors_total{peer_host=\"host/0\"} 2"), std::string::npos) << text;
  EXPECT_NE(text.find("collserve_backend_errors_total{peer_host=\"host/255\"} 1"), std::string::npos);
  EXPECT_EQ(text.find("peer_host=\"host/256\""), std::string::npos);
  EXPECT_NE(text.find("collserve_backend_errors_total{peer_host=\"other\"} 44"), std::string::npos) << text;
}

}  // namespace
}  // namespace collserve::server
