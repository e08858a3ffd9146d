{{/* The chart's name, or nameOverride. */}}
{{- define "loomserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's prefix for every object: fullnameOverride, or release-chart, once. */}}
{{- define "loomserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "loomserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "loomserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: call with (dict "root" $ "component" "worker"). */}}
{{- define "loomserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loomserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "loomserve.workerName" -}}
{{ include "loomserve.fullname" . }}-worker
{{- end }}

{{- define "loomserve.gatewayName" -}}
{{ include "loomserve.fullname" . }}-gateway
{{- end }}

{{- define "loomserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
A container's env list from LOOMSERVE_* settings: (dict "defaults" d "env" values "wiring" w).
The user's values override the defaults; the wiring, which must agree with the Services,
overrides both. Anything but a LOOMSERVE_* name is refused: it would be silently ignored.
*/}}
{{- define "loomserve.env" -}}
{{- $env := mustMergeOverwrite (deepCopy .defaults) (deepCopy (.env | default dict)) .wiring }}
{{- range $name, $value := $env }}
{{- if not (hasPrefix "LOOMSERVE_" $name) }}
{{- fail (printf "%s is no loomserve setting: env takes LOOMSERVE_* variables only" $name) }}
{{- end }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}

{{/* prometheus.io scrape annotations for a port and path, when metrics.podAnnotations. */}}
{{- define "loomserve.scrapeAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}
