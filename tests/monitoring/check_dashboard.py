#!/usr/bin/env python3
"""monitoring_dashboard: checks helm/collserve/files/dashboard.json offline.

Every panel's PromQL must parse (each expression goes into a throwaway rule file, with
Grafana's $__rate_interval / $__interval / $__range replaced by 5m, and `promtool check
rules` parses it), every panel uses the ${datasource} variable, panel ids are unique, and
every collserve metric an expression names is one the daemons export (the list below,
kept in step with docs/operations.md) and filters by the namespace, job and instance
variables (replaced by their "All" value, .*, to parse). The variables exist.

Usage: check_dashboard.py DASHBOARD_JSON WORK_DIR
"""
import json
import os
import re
import subprocess
import sys

# Every metric family the coordinator and the sidecar export (docs/operations.md).
EXPORTED = {
    "collserve_build_info", "collserve_rpc_requests_total", "collserve_rpc_duration_seconds",
    "collserve_store_keys", "collserve_store_bytes", "collserve_store_max_keys", "collserve_store_max_bytes",
    "collserve_store_pending_waits", "collserve_store_wal_bytes", "collserve_store_wal_compactions",
    "collserve_registry_groups", "collserve_registry_formed_groups", "collserve_registry_generations_formed_total",
    "collserve_registry_journal_writes_total",
    "collserve_store_wal_syncs_total", "collserve_store_wal_sync_seconds_total", "collserve_store_wal_writes_total",
    "collserve_staging_bytes", "collserve_inline_bytes", "collserve_segments_registered_total", "collserve_segment_bytes_registered_total",
    "collserve_collective_algorithms_total", "collserve_backend_errors_total", "collserve_tcpstore_requests_total",
    "collserve_tcpstore_protocol_errors_total", "collserve_tcpstore_evicted_connections_total",
    "collserve_store_snapshot_timestamp_seconds",
    "collserve_collectives_total", "collserve_collective_duration_seconds", "collserve_collective_bytes_total",
    "collserve_collective_bus_bytes_total", "collserve_tensor_bytes_total", "collserve_argument_exchanges_total",
    "collserve_groups", "collserve_sessions", "collserve_collectives_in_flight",
    "collserve_oldest_collective_age_seconds", "collserve_coordinator_connected",
    "collserve_collective_arrival_skew_seconds", "collserve_straggler_collectives_total",
    "collserve_job_data_path_seconds_total", "collserve_job_data_path_chunks_total",
    "collserve_job_data_path_loops_total", "collserve_job_data_path_wait_seconds_total",
    "collserve_job_collectives_total", "collserve_job_collective_bytes_total", "collserve_job_stage_seconds_total",
    "collserve_link_cut_transfers_total", "collserve_link_pieces_total", "collserve_link_waits_total",
    "collserve_link_wait_seconds_total",
}


def exprs(dashboard):
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel, target["expr"]


def main():
    dashboard_path, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    with open(dashboard_path) as f:
        dashboard = json.load(f)
    errors = []
    variables = {v["name"] for v in dashboard.get("templating", {}).get("list", [])}
    for var in ("datasource", "namespace", "job", "instance"):
        if var not in variables:
            errors.append(f"the dashboard has no ${var} variable")
    ids = [p["id"] for p in dashboard["panels"]]
    if len(ids) != len(set(ids)):
        errors.append("panel ids repeat")
    rules = []
    for panel, expr in exprs(dashboard):
        # Label names (collserve_job) are not metrics: drop the label lists of by/without/on/ignoring.
        metrics_only = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)
        if panel.get("datasource", {}).get("uid") != "${datasource}":
            errors.append(f"panel {panel['title']!r} does not use the ${{datasource}} variable")
        for name in re.findall(r"collserve_[a-z_]+", metrics_only):
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            if family not in EXPORTED and name not in EXPORTED:
                errors.append(f"panel {panel['title']!r} names {name}, which no daemon exports")
        # Every selector of a collserve metric filters by the dashboard's variables (issue 40:
        # one dashboard for several namespaces, Prometheus jobs and instances).
        for selector in re.findall(r"collserve_[a-z_]+(?:\{[^}]*\})?", metrics_only):
            for var in ("namespace", "job", "instance"):
                if f'{var}=~"${var}"' not in selector:
                    errors.append(f"panel {panel['title']!r}: {selector} does not filter by ${var}")
        promql = re.sub(r"\$__(rate_interval|interval|range)", "5m", expr)
        promql = re.sub(r"\$(namespace|job|instance)\b", ".*", promql)  # the variables' "All"
        rules.append({"record": f"dashboard:panel_{panel['id']}:expr_{len(rules)}", "expr": promql})
    if not rules:
        errors.append("the dashboard has no expressions")
    rule_file = os.path.join(work, "dashboard_exprs.yml")
    with open(rule_file, "w") as f:
        json.dump({"groups": [{"name": "dashboard", "rules": rules}]}, f, indent=1)  # JSON is YAML
    check = subprocess.run(["promtool", "check", "rules", rule_file], capture_output=True, text=True, timeout=60)
    if check.returncode != 0:
        errors.append(f"promtool check rules failed on the dashboard's expressions:\n{check.stdout}{check.stderr}")
    for e in errors:
        print("check_dashboard: FAIL:", e, file=sys.stderr)
    if not errors:
        print(f"check_dashboard: {len(rules)} expressions of {len(dashboard['panels'])} panels parse")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
