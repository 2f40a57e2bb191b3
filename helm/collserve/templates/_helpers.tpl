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
