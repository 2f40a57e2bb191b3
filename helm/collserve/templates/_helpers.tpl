{{/*
Chart name, as in app.kubernetes.io/name.
*/}}
{{- define "collserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Default fully qualified app name: <release>-<chart>, or the release name alone when it
already contains the chart name. Truncated to 63 characters (the DNS label limit).
*/}}
{{- define "collserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Name of one component's resources: <fullname>-<component>. The prefix is cut to 40
characters so that StatefulSet and DaemonSet names stay within 52 (their pods carry a
controller-revision-hash label of name + 11 characters) and the names of the two
components never collide.
Usage: include "collserve.componentName" (dict "context" $ "component" "coordinator")
*/}}
{{- define "collserve.componentName" -}}
{{- printf "%s-%s" (include "collserve.fullname" .context | trunc 40 | trimSuffix "-") .component }}
{{- end }}

{{/*
Chart name and version, as in the helm.sh/chart label.
*/}}
{{- define "collserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: name, instance and (when given) component. Selectors are immutable, so
they never carry the version or the chart.
Usage: include "collserve.selectorLabels" (dict "context" $ "component" "sidecar")
*/}}
{{- define "collserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "collserve.name" .context }}
app.kubernetes.io/instance: {{ .context.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{/*
Common labels: the selector labels plus version, part-of, managed-by, the chart and
commonLabels.
Usage: include "collserve.labels" (dict "context" $ "component" "coordinator")
*/}}
{{- define "collserve.labels" -}}
helm.sh/chart: {{ include "collserve.chart" .context }}
{{ include "collserve.selectorLabels" . }}
{{- with .context.Chart.AppVersion }}
app.kubernetes.io/version: {{ . | quote }}
{{- end }}
app.kubernetes.io/part-of: {{ include "collserve.name" .context }}
app.kubernetes.io/managed-by: {{ .context.Release.Service }}
{{- with .context.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Name of the ServiceAccount the pods use.
*/}}
{{- define "collserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "collserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Image reference: repository:tag, the tag defaulting to the chart's appVersion.
Usage: include "collserve.image" (dict "context" $ "image" .Values.coordinator.image)
*/}}
{{- define "collserve.image" -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .context.Chart.AppVersion | toString) }}
{{- end }}

{{/*
Container args from a flag map: one "--key=value" per entry, sorted by key; null values
are skipped and empty strings kept ("--data_dir=" means memory only). Whole numbers are
printed in full: values files hand integers to templates as float64, which %v would print
as 6.7108864e+07.
Usage: include "collserve.args" $flags
*/}}
{{- define "collserve.args" -}}
{{- range $key, $value := . }}
{{- if not (kindIs "invalid" $value) }}
{{- $text := printf "%v" $value }}
{{- /* Nested, not "and": Go templates before 1.18 evaluate every operand of "and". */}}
{{- if kindIs "float64" $value }}
{{- if eq $value (float64 (int64 $value)) }}
{{- $text = printf "%d" (int64 $value) }}
{{- end }}
{{- end }}
- {{ printf "--%s=%s" $key $text | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The coordinator's client address, host:port, for the sidecars and training pods.
*/}}
{{- define "collserve.coordinatorAddress" -}}
{{- printf "%s.%s.svc:%d" (include "collserve.componentName" (dict "context" . "component" "coordinator")) .Release.Namespace (int .Values.coordinator.service.grpcPort) }}
{{- end }}

{{/*
Where a component's TLS Secret is mounted (read-only, the whole Secret as a directory: a
subPath mount would never see a renewed certificate).
*/}}
{{- define "collserve.tlsDir" -}}
/etc/collserve/tls
{{- end }}

{{/*
Name of the coordinator's TLS Secret: coordinator.tls.secretName, default
<coordinator name>-tls.
*/}}
{{- define "collserve.coordinatorTLSSecret" -}}
{{- .Values.coordinator.tls.secretName | default (printf "%s-tls" (include "collserve.componentName" (dict "context" . "component" "coordinator"))) }}
{{- end }}

{{/*
Name of the sidecars' TLS Secret: sidecar.tls.secretName, default <sidecar name>-tls.
*/}}
{{- define "collserve.sidecarTLSSecret" -}}
{{- .Values.sidecar.tls.secretName | default (printf "%s-tls" (include "collserve.componentName" (dict "context" . "component" "sidecar"))) }}
{{- end }}

{{/*
Name of the training processes' client-certificate Secret (tls.certManager.clientCertificate).
*/}}
{{- define "collserve.clientTLSSecret" -}}
{{- .Values.tls.certManager.clientCertificate.secretName | default (printf "%s-client-tls" (include "collserve.fullname" . | trunc 52 | trimSuffix "-")) }}
{{- end }}

{{/*
"true" when the sidecars mount their TLS Secret: for their own listener, or to verify (and,
with mutual TLS, authenticate to) a coordinator that speaks TLS.
*/}}
{{- define "collserve.sidecarMountsTLS" -}}
{{- if or .Values.sidecar.tls.enabled .Values.coordinator.tls.enabled }}true{{ end }}
{{- end }}

{{/*
The TLS volume of a pod: the Secret named by "secret", mounted whole (keys tls.crt, tls.key,
ca.crt). defaultMode 0440 (288): readable by the owner (root) and the pod's fsGroup.
Usage: include "collserve.tlsVolume" "secret-name"
*/}}
{{- define "collserve.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ . }}
    defaultMode: 288
{{- end }}

{{/*
The mount of collserve.tlsVolume: a directory, read-only, never a subPath.
*/}}
{{- define "collserve.tlsVolumeMount" -}}
- name: tls
  mountPath: {{ include "collserve.tlsDir" . }}
  readOnly: true
{{- end }}

{{/*
Probe handler on the gRPC port named "grpc": grpc.health.v1 in plaintext; tcpSocket when the
port speaks TLS, because the kubelet's gRPC probe cannot do a TLS handshake (tcpSocket only
checks that the port accepts connections, which it does once the daemon serves).
Usage: include "collserve.probeHandler" (dict "tls" <bool> "port" <number> ["service" <name>])
A gRPC probe checks grpc.health.v1 for "service": "" (readiness: a sidecar is SERVING only
while its coordinator answers) or "liveness" (SERVING while the daemon serves, so a kubelet
never restarts a sidecar because its coordinator is down).
*/}}
{{- define "collserve.probeHandler" -}}
{{- if .tls }}
tcpSocket:
  port: grpc
{{- else }}
grpc:
  port: {{ .port }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{- end }}
{{- end }}

{{/*
One NetworkPolicy peer from a networkPolicy.* selector pair: pods matching podSelector in
namespaces matching namespaceSelector (both in one entry, so both must match; {} matches all).
Usage: include "collserve.networkPeer" .Values.networkPolicy.trainingPods
*/}}
{{- define "collserve.networkPeer" -}}
{{- if .namespaceSelector }}
- namespaceSelector:
    {{- toYaml .namespaceSelector | nindent 4 }}
{{- else }}
- namespaceSelector: {}
{{- end }}
{{- if .podSelector }}
  podSelector:
    {{- toYaml .podSelector | nindent 4 }}
{{- else }}
  podSelector: {}
{{- end }}
{{- end }}

{{/*
Where the coordinator's token Secrets are mounted (read-only, each Secret whole as a
directory, so a rotated token reaches the pod): the admin token's Secret (the file
<dir>/<coordinator.auth.adminTokenKey> is --admin_token_file) and the job tokens' Secret
(the directory is --job_tokens_dir: one file per job, named after it).
*/}}
{{- define "collserve.adminTokenDir" -}}
/etc/collserve/admin-token
{{- end }}
{{- define "collserve.jobTokensDir" -}}
/etc/collserve/job-tokens
{{- end }}

{{/*
Fails the render when the coordinator's final flags (coordinator.auth plus coordinator.args)
give it no credential source: collserve-coordinator refuses to start that way ("no
credentials configured"), and the chart cannot make a token Secret safely itself.
Usage: include "collserve.requireCredentials" $flags
*/}}
{{- define "collserve.requireCredentials" -}}
{{- $ok := false }}
{{- range $flag := list "admin_token_file" "job_tokens_dir" }}
{{- $value := index $ $flag }}
{{- if not (kindIs "invalid" $value) }}
{{- if ne (toString $value) "" }}
{{- $ok = true }}
{{- end }}
{{- end }}
{{- end }}
{{- $allow := index $ "allow_unauthenticated" }}
{{- if not (kindIs "invalid" $allow) }}
{{- if eq (toString $allow) "true" }}
{{- $ok = true }}
{{- end }}
{{- end }}
{{- if not $ok }}
{{- fail "coordinator.auth: no credentials configured (collserve-coordinator refuses to start without them): set coordinator.auth.jobTokensSecret and/or coordinator.auth.adminTokenSecret to an existing Secret (e.g. kubectl create secret generic collserve-job-tokens --from-literal=<job>=$(openssl rand -hex 32)), or coordinator.auth.allowUnauthenticated=true on a trusted network only; the chart creates no token Secret" }}
{{- end }}
{{- end }}
