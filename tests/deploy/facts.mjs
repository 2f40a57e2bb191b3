// Prints the facts of rendered manifests that chart_test.sh asserts, one per line, so the
// test can match whole lines (grep -x) instead of YAML text that formatting may change:
//
//   node facts.mjs FILE...
//
//   <Kind>/<name>                                       every object
//   <Kind>/<name> hostNetwork=<bool> | hostIPC=<bool>   workloads (false when unset); a
//       PyTorchJob's facts are those of each replica type's template, as <Kind>/<name>/<type>
//   <Kind>/<name> podLabel <k>=<v>                      each label of the pod template
//   Service/<name> port <name> <port>                   each Service port
//   <Kind>/<name> volume <name> <type>[=<what>]         secret=<secretName>, hostPath=<path>, ...
//   <Kind>/<name> volume <name> items <key,...>         a secret/configMap volume with items
//                                                       (only those keys, not the whole object)
//   <Kind>/<name> container <c> arg <arg>               each argument
//   <Kind>/<name> container <c> env <NAME>              each environment variable
//   <Kind>/<name> container <c> env <NAME> from <src>   where it comes from: value (a literal,
//       never printed), secretKeyRef=<secret>/<key>, configMapKeyRef=<map>/<key>,
//       fieldRef=<path>, resourceFieldRef=<resource>
//   <Kind>/<name> container <c> env <NAME>=<value>      the literal of the few that say where to
//       connect and which job (COLLSERVE_SIDECAR, COLLSERVE_COORDINATOR, COLLSERVE_JOB,
//       MASTER_ADDR, MASTER_PORT), never a credential
//   <Kind>/<name> container <c> mount <volume> <path> readOnly=<bool> subPath=<subPath|->
//   <Kind>/<name> container <c> probe <probe> <handler> grpc, tcpSocket, httpGet or exec
//   NetworkPolicy/<name> policyTypes <types,...>
//   NetworkPolicy/<name> ingress <port|*>/<protocol> from <peer>
//       peer: pods{k=v,...} in ns{k=v,...} | pods{...} (the policy's namespace) | ipBlock <cidr>
//       | any; {} = all
//   Certificate/<name> secretName <name> | issuer <kind>/<name> | usage <usage> | dnsName <name>
//
// The packages are resolved from this file's location (chart_test.sh copies it next to them).
import { readFileSync } from "node:fs";
import { parseAllDocuments } from "yaml";

const out = [];
const selector = (s) => {
  if (!s) return "{}";
  const parts = Object.entries(s.matchLabels ?? {}).map(([k, v]) => `${k}=${v}`);
  for (const e of s.matchExpressions ?? []) parts.push(`${e.key} ${e.operator} ${(e.values ?? []).join("|")}`.trim());
  return `{${parts.join(",")}}`;
};
const peer = (p) => {
  if (p.ipBlock) return `ipBlock ${p.ipBlock.cidr}${(p.ipBlock.except ?? []).map((e) => ` except ${e}`).join("")}`;
  const pods = `pods${selector(p.podSelector)}`;
  return p.namespaceSelector ? `${pods} in ns${selector(p.namespaceSelector)}` : pods;
};
const templateOf = (obj) =>
  obj.kind === "Pod" ? obj : obj.kind === "CronJob" ? obj.spec?.jobTemplate?.spec?.template : obj.spec?.template;
// [id suffix, template] of each pod template: a PyTorchJob's are "<id>/<replica type>".
const templatesOf = (obj) =>
  obj.kind === "PyTorchJob"
    ? Object.entries(obj.spec?.pytorchReplicaSpecs ?? {}).map(([type, r]) => [`/${type}`, r?.template])
    : [["", templateOf(obj)]];
// Literal env values printed (where to connect, which job): never a credential's.
const PRINTED_ENV = new Set(["COLLSERVE_SIDECAR", "COLLSERVE_COORDINATOR", "COLLSERVE_JOB", "MASTER_ADDR", "MASTER_PORT"]);

for (const file of process.argv.slice(2)) {
  for (const doc of parseAllDocuments(readFileSync(file, "utf8"))) {
    const obj = doc.toJSON();
    if (!obj?.kind) continue;
    const id = `${obj.kind}/${obj.metadata?.name}`;
    out.push(id);
    if (obj.kind === "Service") {
      for (const p of obj.spec?.ports ?? []) out.push(`${id} port ${p.name ?? "-"} ${p.port}`);
    }
    for (const [suffix, template] of obj.kind === "NetworkPolicy" ? [] : templatesOf(obj)) {
      const spec = template?.spec;
      if (!spec?.containers) continue;
      const id = `${obj.kind}/${obj.metadata?.name}${suffix}`;
      if (suffix) out.push(id);
      for (const [k, v] of Object.entries(template.metadata?.labels ?? {})) out.push(`${id} podLabel ${k}=${v}`);
      out.push(`${id} hostNetwork=${spec.hostNetwork === true}`, `${id} hostIPC=${spec.hostIPC === true}`);
      for (const v of spec.volumes ?? []) {
        const type = Object.keys(v).find((k) => k !== "name");
        const what = v.secret?.secretName ?? v.hostPath?.path ?? v.configMap?.name ?? v.persistentVolumeClaim?.claimName;
        out.push(`${id} volume ${v.name} ${type}${what !== undefined ? `=${what}` : ""}`);
        const items = v.secret?.items ?? v.configMap?.items;
        if (items) out.push(`${id} volume ${v.name} items ${items.map((i) => i.key).join(",")}`);
      }
      for (const c of [...(spec.initContainers ?? []), ...spec.containers]) {
        const cid = `${id} container ${c.name}`;
        for (const a of [...(c.command ?? []), ...(c.args ?? [])]) out.push(`${cid} arg ${a}`);
        for (const e of c.env ?? []) {
          const f = e.valueFrom ?? {};
          const from = f.secretKeyRef
            ? `secretKeyRef=${f.secretKeyRef.name}/${f.secretKeyRef.key}`
            : f.configMapKeyRef
              ? `configMapKeyRef=${f.configMapKeyRef.name}/${f.configMapKeyRef.key}`
              : f.fieldRef
                ? `fieldRef=${f.fieldRef.fieldPath}`
                : f.resourceFieldRef
                  ? `resourceFieldRef=${f.resourceFieldRef.resource}`
                  : "value";
          out.push(`${cid} env ${e.name}`, `${cid} env ${e.name} from ${from}`);
          if (from === "value" && PRINTED_ENV.has(e.name)) out.push(`${cid} env ${e.name}=${e.value}`);
        }
        for (const m of c.volumeMounts ?? []) {
          out.push(`${cid} mount ${m.name} ${m.mountPath} readOnly=${m.readOnly === true} subPath=${m.subPath ?? "-"}`);
        }
        for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
          const p = c[probe];
          if (p) out.push(`${cid} probe ${probe} ${["grpc", "tcpSocket", "httpGet", "exec"].find((h) => p[h]) ?? "none"}`);
        }
      }
    }
    if (obj.kind === "NetworkPolicy") {
      out.push(`${id} policyTypes ${(obj.spec?.policyTypes ?? []).join(",")}`);
      for (const rule of obj.spec?.ingress ?? []) {
        const ports = rule.ports?.length ? rule.ports.map((p) => `${p.port ?? "*"}/${p.protocol ?? "TCP"}`) : ["*/*"];
        const peers = rule.from?.length ? rule.from.map(peer) : ["any"];
        for (const port of ports) for (const from of peers) out.push(`${id} ingress ${port} from ${from}`);
      }
    }
    if (obj.kind === "Certificate") {
      const s = obj.spec ?? {};
      out.push(`${id} secretName ${s.secretName}`, `${id} issuer ${s.issuerRef?.kind ?? "Issuer"}/${s.issuerRef?.name}`);
      for (const u of s.usages ?? []) out.push(`${id} usage ${u}`);
      for (const n of s.dnsNames ?? []) out.push(`${id} dnsName ${n}`);
    }
  }
}
console.log(out.join("\n"));
