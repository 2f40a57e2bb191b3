// Validates Kubernetes manifests offline, without a cluster.
//
//   node validate.mjs FILE...
//
// Every YAML document of every FILE is checked against the OpenAPI schema of its kind
// (npm kubernetes-models; monitoring.coreos.com kinds via
// @kubernetes-models/prometheus-operator, cert-manager.io kinds via
// @kubernetes-models/cert-manager), then by the checks below, which the schemas
// cannot express. The FILEs form one set for the cross-document checks (a Service must
// select a workload of the set, and so on). Prints one line per document and per
// problem; exits 1 when anything failed, 2 on bad usage.
//
// The packages are resolved from this file's location: chart_test.sh copies it into the
// npm prefix that holds them.
//
// Known blind spots (they need an API server): unknown or misspelled fields, and most
// value ranges and cross-field rules the API server enforces.
import { readFileSync } from "node:fs";
import { parseAllDocuments } from "yaml";

const WORKLOAD_KINDS = new Set(["Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob", "Pod", "PyTorchJob"]);
// Workloads whose containers run until stopped: they need readiness and liveness probes.
const LONG_RUNNING_KINDS = new Set(["Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"]);
// Labels every object carries (Kubernetes recommended labels).
const REQUIRED_LABELS = ["app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by"];
// Selectors are immutable: a label that changes on upgrade must never be in one.
const MUTABLE_LABELS = ["app.kubernetes.io/version", "helm.sh/chart"];

const files = process.argv.slice(2);
if (files.length === 0) {
  console.error("usage: node validate.mjs FILE...");
  process.exit(2);
}

let failures = 0;
const fail = (where, message) => {
  failures++;
  console.log(`FAIL ${where}: ${message}`);
};

// Loads the model class of apiVersion/kind, or null when no package knows it.
async function loadModel(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  const pkg =
    { "monitoring.coreos.com": "@kubernetes-models/prometheus-operator", "cert-manager.io": "@kubernetes-models/cert-manager" }[group] ??
    "kubernetes-models";
  const path = group ? `${pkg}/${group}/${version}/${kind}` : `${pkg}/${version}/${kind}`;
  try {
    return (await import(path))[kind] ?? null;
  } catch (e) {
    if (e.code === "ERR_PACKAGE_PATH_NOT_EXPORTED" || e.code === "ERR_MODULE_NOT_FOUND") return null;
    throw e;
  }
}

// kubeflow.org/v1 PyTorchJob (the Kubeflow training operator; no npm package has its
// schema): the fields of its v1 API that a manifest sets, as the operator's CRD types them
// (PyTorchJobSpec: pytorchReplicaSpecs, runPolicy, elasticPolicy, nprocPerNode), an unknown
// field refused; each replica's template is checked as a core/v1 PodTemplate's template.
const PYTORCHJOB_REPLICA_TYPES = new Set(["Master", "Worker"]);
const PYTORCHJOB_RESTART_POLICIES = new Set(["Always", "OnFailure", "Never", "ExitCode"]);
const PYTORCHJOB_RUN_POLICY = {
  cleanPodPolicy: (v) => ["All", "Running", "None"].includes(v),
  ttlSecondsAfterFinished: (v) => Number.isInteger(v) && v >= 0,
  activeDeadlineSeconds: (v) => Number.isInteger(v) && v >= 0,
  backoffLimit: (v) => Number.isInteger(v) && v >= 0,
  suspend: (v) => typeof v === "boolean",
  schedulingPolicy: (v) => typeof v === "object" && v !== null,
  managedBy: (v) => typeof v === "string",
};
class PyTorchJobModel {
  constructor(obj) {
    this.obj = obj;
  }
  async check() {
    const problems = [];
    const spec = this.obj.spec;
    if (typeof spec !== "object" || spec === null) return ["spec must be an object"];
    for (const k of Object.keys(spec)) {
      if (!["pytorchReplicaSpecs", "runPolicy", "elasticPolicy", "nprocPerNode"].includes(k)) problems.push(`spec has unknown field ${k}`);
    }
    const replicas = spec.pytorchReplicaSpecs;
    if (typeof replicas !== "object" || replicas === null || Object.keys(replicas).length === 0) {
      return [...problems, "spec must have required property pytorchReplicaSpecs"];
    }
    const PodTemplate = await loadModel("v1", "PodTemplate");
    for (const [type, r] of Object.entries(replicas)) {
      const at = `spec/pytorchReplicaSpecs/${type}`;
      if (!PYTORCHJOB_REPLICA_TYPES.has(type)) problems.push(`${at}: replica type must be Master or Worker`);
      for (const k of Object.keys(r ?? {})) {
        if (!["replicas", "restartPolicy", "template"].includes(k)) problems.push(`${at} has unknown field ${k}`);
      }
      if (!Number.isInteger(r?.replicas) || r.replicas < 0) problems.push(`${at}/replicas must be an integer >= 0`);
      if (type === "Master" && r?.replicas !== 1) problems.push(`${at}/replicas must be 1 (one rank 0)`);
      if (r?.restartPolicy !== undefined && !PYTORCHJOB_RESTART_POLICIES.has(r.restartPolicy)) {
        problems.push(`${at}/restartPolicy must be one of ${[...PYTORCHJOB_RESTART_POLICIES].join(", ")}`);
      }
      if (!r?.template) {
        problems.push(`${at} must have required property template`);
        continue;
      }
      try {
        new PodTemplate({ apiVersion: "v1", kind: "PodTemplate", metadata: { name: "check" }, template: r.template }).validate();
      } catch (e) {
        problems.push(`${at}/template: ${e.message}`);
      }
      // The operator finds the container named "pytorch" (and, on the Master, its port
      // "pytorchjob-port", which becomes MASTER_PORT).
      const containers = r.template.spec?.containers ?? [];
      const pytorch = containers.find((c) => c.name === "pytorch");
      if (!pytorch) problems.push(`${at}/template has no container named "pytorch" (the operator's default container)`);
      if (type === "Master" && pytorch && !(pytorch.ports ?? []).some((p) => p.name === "pytorchjob-port")) {
        problems.push(`${at}: container pytorch has no port named "pytorchjob-port" (MASTER_PORT)`);
      }
    }
    for (const [k, v] of Object.entries(spec.runPolicy ?? {})) {
      if (!PYTORCHJOB_RUN_POLICY[k]) problems.push(`spec/runPolicy has unknown field ${k}`);
      else if (!PYTORCHJOB_RUN_POLICY[k](v)) problems.push(`spec/runPolicy/${k} has a bad value ${JSON.stringify(v)}`);
    }
    return problems;
  }
}

// Every pod template of a workload (a PyTorchJob has one per replica type).
const podTemplatesOf = (obj) =>
  obj.kind === "PyTorchJob"
    ? Object.values(obj.spec?.pytorchReplicaSpecs ?? {}).map((r) => r?.template).filter(Boolean)
    : [podTemplateOf(obj)].filter(Boolean);
const podTemplateOf = (obj) => {
  switch (obj.kind) {
    case "Pod":
      return { metadata: obj.metadata, spec: obj.spec };
    case "CronJob":
      return obj.spec?.jobTemplate?.spec?.template;
    default:
      return obj.spec?.template;
  }
};

const isSubset = (small, big) => Object.entries(small ?? {}).every(([k, v]) => big?.[k] === v);
const validPort = (p) => Number.isInteger(p) && p >= 1 && p <= 65535;

// Volume kinds whose content the kubelet updates in place (a renewed certificate, an edited
// ConfigMap); a subPath mount of them is a copy that never sees an update.
const UPDATED_VOLUME_KINDS = ["secret", "configMap", "projected", "downwardAPI"];
// Flags whose value is a file or directory the daemon reads (TLS material, the
// coordinator's token files): it must lie in a mounted volume.
const FILE_FLAG = /^--([a-z_]*tls_(?:cert|key|ca)|admin_token_file|job_tokens_dir)=(\/.*)$/;
// A flag that would carry a token itself (--token=..., --admin_token=...): anyone who can
// read the pod spec or the node's process list would have it.
const TOKEN_FLAG = /^--[a-z_]*token=/;
// Environment variables that hold a credential: they must come from a Secret
// (valueFrom.secretKeyRef), never a literal value in the manifest.
const CREDENTIAL_ENV = new Set(["COLLSERVE_TOKEN"]);

// Checks one container; `where` names it in messages. `volumes` maps volume names to
// their definitions.
function checkContainer(where, c, { longRunning, volumes }) {
  const volumeNames = new Set(volumes.keys());
  if (!c.image || c.image.endsWith(":latest") || !/[:@]/.test(c.image.split("/").pop())) {
    fail(where, `image "${c.image}" needs an explicit tag or digest (not :latest)`);
  }
  const portNames = new Set();
  for (const p of c.ports ?? []) {
    if (!validPort(p.containerPort)) fail(where, `containerPort ${p.containerPort} is not in 1..65535`);
    if (p.hostPort !== undefined && !validPort(p.hostPort)) fail(where, `hostPort ${p.hostPort} is not in 1..65535`);
    if (p.name !== undefined) {
      if (p.name.length > 15) fail(where, `port name "${p.name}" is longer than 15 characters`);
      if (portNames.has(p.name)) fail(where, `port name "${p.name}" is used twice`);
      portNames.add(p.name);
    }
  }
  // $(VAR) is expanded only from the container's own env; an unknown one stays literal.
  const envNames = new Set((c.env ?? []).map((e) => e.name));
  if (envNames.size !== (c.env ?? []).length) fail(where, "an env variable is defined twice");
  if (!c.envFrom) {
    const texts = [...(c.command ?? []), ...(c.args ?? []), ...(c.env ?? []).map((e) => e.value ?? "")];
    for (const text of texts) {
      for (const [, name] of String(text).matchAll(/(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
        if (!envNames.has(name)) fail(where, `"${text}" refers to $(${name}), which is not in the container's env`);
      }
    }
  }
  for (const m of c.volumeMounts ?? []) {
    if (!volumeNames.has(m.name)) fail(where, `volumeMount "${m.name}" has no volume of that name`);
    const kind = UPDATED_VOLUME_KINDS.find((k) => volumes.get(m.name)?.[k]);
    if (kind && m.subPath) {
      fail(where, `volumeMount "${m.name}" mounts a ${kind} volume with subPath: it never sees an update (a rotated certificate or token)`);
    }
  }
  // TLS and token files must be in a mounted volume, tokens never in the manifest, and a
  // kubelet gRPC probe cannot reach a TLS port.
  const args = [...(c.command ?? []), ...(c.args ?? [])].map(String);
  const mountPaths = (c.volumeMounts ?? []).map((m) => m.mountPath.replace(/\/+$/, ""));
  for (const arg of args) {
    const m = FILE_FLAG.exec(arg);
    if (m && !mountPaths.some((p) => m[2] === p || m[2].startsWith(`${p}/`))) fail(where, `"${arg}" is not in any volumeMount`);
    if (TOKEN_FLAG.test(arg)) fail(where, `"${arg.replace(/=.*/, "=...")}" passes a token on the command line: mount it from a Secret and pass the file`);
  }
  for (const e of c.env ?? []) {
    if (CREDENTIAL_ENV.has(e.name) && !e.valueFrom?.secretKeyRef) {
      fail(where, `env ${e.name} is not from a Secret: use valueFrom.secretKeyRef (or mount the Secret and set ${e.name}_FILE)`);
    }
  }
  const tls = args.some((a) => /^--tls_cert=./.test(a));
  const probes = ["startupProbe", "readinessProbe", "livenessProbe"];
  for (const probe of probes) {
    const p = c[probe];
    if (!p) continue;
    if (p.grpc && !validPort(p.grpc.port)) fail(where, `${probe}.grpc.port ${p.grpc.port} must be a number in 1..65535`);
    if (p.grpc && tls) fail(where, `${probe} is a gRPC probe but the container serves TLS (--tls_cert): the kubelet's gRPC probe cannot speak TLS`);
    for (const handler of [p.httpGet, p.tcpSocket]) {
      if (typeof handler?.port === "string" && !portNames.has(handler.port)) {
        fail(where, `${probe} uses port "${handler.port}", which the container does not name`);
      }
    }
  }
  if (longRunning) {
    for (const probe of ["readinessProbe", "livenessProbe"]) {
      if (!c[probe]) fail(where, `long-running container has no ${probe}`);
    }
  }
}

// Per-document checks beyond the schema.
function checkObject(where, obj) {
  const labels = obj.metadata?.labels ?? {};
  for (const l of REQUIRED_LABELS) if (!labels[l]) fail(where, `missing label ${l}`);
  if ((WORKLOAD_KINDS.has(obj.kind) || obj.kind === "Service") && !labels["app.kubernetes.io/component"]) {
    fail(where, "missing label app.kubernetes.io/component");
  }

  if (obj.kind === "Service") {
    for (const p of obj.spec?.ports ?? []) {
      if (!validPort(p.port)) fail(where, `service port ${p.port} is not in 1..65535`);
      if (typeof p.targetPort === "number" && !validPort(p.targetPort)) fail(where, `targetPort ${p.targetPort} is not in 1..65535`);
    }
    if (!obj.spec?.selector || Object.keys(obj.spec.selector).length === 0) fail(where, "service has no selector");
  }

  if (!WORKLOAD_KINDS.has(obj.kind)) return;
  const templates = podTemplatesOf(obj);
  if (templates.length === 0 || templates.some((t) => !t?.spec)) {
    fail(where, "no pod template");
    return;
  }
  for (const template of templates) checkTemplate(where, obj, template);
}

// Checks one pod template of a workload.
function checkTemplate(where, obj, template) {
  const podLabels = template.metadata?.labels ?? {};
  const selector = obj.spec?.selector?.matchLabels;
  if (["Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"].includes(obj.kind)) {
    if (!selector || Object.keys(selector).length === 0) fail(where, "spec.selector.matchLabels is empty");
    if (!isSubset(selector, podLabels)) fail(where, "spec.selector.matchLabels does not match the pod template's labels");
    for (const l of MUTABLE_LABELS) if (selector?.[l] !== undefined) fail(where, `selector contains ${l}, which changes on upgrade`);
  }
  for (const l of ["app.kubernetes.io/name", "app.kubernetes.io/instance"]) {
    if (!podLabels[l]) fail(where, `pod template is missing label ${l}`);
  }

  const spec = template.spec;
  if (spec.hostNetwork && spec.dnsPolicy !== "ClusterFirstWithHostNet") {
    fail(where, "hostNetwork without dnsPolicy: ClusterFirstWithHostNet cannot resolve Service names");
  }
  const volumes = new Map((spec.volumes ?? []).map((v) => [v.name, v]));
  for (const claim of obj.kind === "StatefulSet" ? obj.spec.volumeClaimTemplates ?? [] : []) {
    volumes.set(claim.metadata?.name, { persistentVolumeClaim: {} });
  }
  const longRunning = LONG_RUNNING_KINDS.has(obj.kind);
  const names = new Set();
  for (const [list, isInit] of [[spec.containers ?? [], false], [spec.initContainers ?? [], true]]) {
    for (const c of list) {
      const cwhere = `${where} container ${c.name}`;
      if (names.has(c.name)) fail(cwhere, "container name used twice");
      names.add(c.name);
      // A native sidecar (init container that restarts) runs for the pod's lifetime.
      const sidecar = isInit && c.restartPolicy === "Always";
      checkContainer(cwhere, c, { longRunning: (longRunning && !isInit) || sidecar, volumes });
    }
  }
}

// Checks across the documents of the set.
function checkSet(objects) {
  const seen = new Set();
  for (const { where, obj } of objects) {
    const key = `${obj.kind}/${obj.metadata?.namespace ?? ""}/${obj.metadata?.name}`;
    if (seen.has(key)) fail(where, `${obj.kind} ${obj.metadata?.name} is defined twice`);
    seen.add(key);
  }
  const workloads = objects.filter(({ obj }) => WORKLOAD_KINDS.has(obj.kind));
  const services = objects.filter(({ obj }) => obj.kind === "Service");
  for (const { where, obj } of services) {
    const selector = obj.spec?.selector;
    if (!selector) continue;
    const pods = workloads.flatMap(({ obj: w }) => podTemplatesOf(w)).filter((t) => t && isSubset(selector, t.metadata?.labels));
    if (pods.length === 0) {
      fail(where, `selector ${JSON.stringify(selector)} matches no pod template in the set`);
      continue;
    }
    const portNames = new Set();
    for (const t of pods) for (const c of t.spec?.containers ?? []) for (const p of c.ports ?? []) if (p.name) portNames.add(p.name);
    for (const p of obj.spec?.ports ?? []) {
      if (typeof p.targetPort === "string" && !portNames.has(p.targetPort)) {
        fail(where, `targetPort "${p.targetPort}" is not a container port name of the selected pods`);
      }
    }
  }
  for (const { where, obj } of workloads.filter(({ obj }) => obj.kind === "StatefulSet")) {
    const svc = services.find(({ obj: s }) => s.metadata?.name === obj.spec?.serviceName);
    if (!svc) fail(where, `serviceName "${obj.spec?.serviceName}" is not a Service of the set`);
    else if (svc.obj.spec?.clusterIP !== "None") fail(where, `serviceName "${obj.spec.serviceName}" is not a headless Service`);
  }
  // A NetworkPolicy must select pods of the set (else it protects nothing), and the named
  // ports of its ingress rules must be container ports of those pods (else the rule admits
  // nothing).
  for (const { where, obj } of objects.filter(({ obj }) => obj.kind === "NetworkPolicy")) {
    const selector = obj.spec?.podSelector?.matchLabels ?? {};
    const pods = workloads.flatMap(({ obj: w }) => podTemplatesOf(w)).filter((t) => t && isSubset(selector, t.metadata?.labels));
    if (pods.length === 0) {
      fail(where, `podSelector ${JSON.stringify(selector)} matches no pod template in the set`);
      continue;
    }
    const portNames = new Set();
    for (const t of pods) {
      for (const c of [...(t.spec?.containers ?? []), ...(t.spec?.initContainers ?? [])]) {
        for (const p of c.ports ?? []) if (p.name) portNames.add(p.name);
      }
    }
    for (const rule of obj.spec?.ingress ?? []) {
      for (const p of rule.ports ?? []) {
        if (typeof p.port === "string" && !portNames.has(p.port)) {
          fail(where, `port "${p.port}" is not a container port name of the selected pods`);
        }
      }
    }
  }
  for (const { where, obj } of objects.filter(({ obj }) => obj.kind === "ServiceMonitor")) {
    const selected = services.filter(({ obj: s }) => isSubset(obj.spec?.selector?.matchLabels, s.metadata?.labels));
    if (selected.length === 0) {
      fail(where, "selector matches no Service in the set");
      continue;
    }
    const portNames = new Set(selected.flatMap(({ obj: s }) => (s.spec?.ports ?? []).map((p) => p.name)));
    for (const e of obj.spec?.endpoints ?? []) {
      if (e.port && !portNames.has(e.port)) fail(where, `endpoint port "${e.port}" is not a port name of the selected Services`);
    }
  }
}

const objects = [];
for (const file of files) {
  const docs = parseAllDocuments(readFileSync(file, "utf8"));
  for (const [index, doc] of (Array.isArray(docs) ? docs : [docs]).entries()) {
    const where0 = `${file} document ${index + 1}`;
    if (doc.errors?.length) {
      fail(where0, `YAML: ${doc.errors.map((e) => e.message).join("; ")}`);
      continue;
    }
    const obj = doc.toJSON();
    if (obj === null || obj === undefined) continue;  // empty document
    if (typeof obj !== "object" || !obj.apiVersion || !obj.kind) {
      fail(where0, "not a Kubernetes object (no apiVersion/kind)");
      continue;
    }
    const where = `${file}: ${obj.kind} ${obj.metadata?.name ?? "<no name>"}`;
    if (!obj.metadata?.name) fail(where, "metadata.name is missing");
    const pytorchJob = obj.apiVersion === "kubeflow.org/v1" && obj.kind === "PyTorchJob";
    const Model = pytorchJob ? PyTorchJobModel : await loadModel(obj.apiVersion, obj.kind);
    if (!Model) {
      fail(where, `unknown apiVersion/kind ${obj.apiVersion} ${obj.kind}`);
      continue;
    }
    const before = failures;
    if (pytorchJob) {
      for (const problem of await new Model(obj).check()) fail(where, `schema: ${problem}`);
    } else {
      try {
        new Model(obj).validate();
      } catch (e) {
        fail(where, `schema: ${e.message}`);
      }
    }
    checkObject(where, obj);
    objects.push({ where, obj });
    if (failures === before) console.log(`OK   ${where}`);
  }
}
checkSet(objects);
console.log(`${objects.length} object(s) in ${files.length} file(s), ${failures} problem(s)`);
process.exit(failures ? 1 : 0);
