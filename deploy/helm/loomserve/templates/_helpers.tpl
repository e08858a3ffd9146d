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

{{/* Selector labels of one component: call with (dict "root" $ "component" "worker"), and
"group" a worker group's label value when the chart has several (none for the one group of
`worker` alone, whose selector stays what it always was: a StatefulSet's cannot change). */}}
{{- define "loomserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loomserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{ include "loomserve.componentLabels" . }}
{{- end }}

{{/* The labels that tell a component (and a worker group) apart, beside loomserve.labels. */}}
{{- define "loomserve.componentLabels" -}}
app.kubernetes.io/component: {{ .component }}
{{- with .group }}
loomserve/model: {{ . }}
{{- end }}
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

{{/* Threads for a CPU quantity ("2", 2, "1500m", "0.5"): whole CPUs rounded up, at least 1,
as the worker itself reads a CPU quota (worker/host_cpus.py). */}}
{{- define "loomserve.cpuThreads" -}}
{{- $cpu := toString . }}
{{- if hasSuffix "m" $cpu }}
{{- max 1 (div (add (atoi (trimSuffix "m" $cpu)) 999) 1000) }}
{{- else }}
{{- max 1 (int (ceil (float64 $cpu))) }}
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

{{/*
The worker groups, one per model: call with (dict "root" $ "out" d); sets d.groups to a list of
  name      the model's served name (--served-model-name), "" for `worker` alone (then the
            worker's own LOOMSERVE_SERVED_MODEL_NAME, or its file's name)
  file      the model's GGUF in the pod (LOOMSERVE_MODEL), "" to leave it to env or the image
  group     the label value that tells the group's pods apart, "" for `worker` alone
  fullName  its StatefulSet's and headless Service's name
  key       where its values come from, for error messages: worker, or models[i]
  values    `worker`'s settings with the model's own over them
No `models`: one group of `worker`, named as the chart always named it. A model's settings
replace worker's key by key, and maps (env, resources, gpu, autoscaling, ...) key by key within.
*/}}
{{- define "loomserve.workerGroups" -}}
{{- $root := .root }}
{{- $groups := list }}
{{- if not $root.Values.models }}
{{- $groups = append $groups (dict "name" "" "file" "" "group" "" "key" "worker" "fullName" (include "loomserve.workerName" $root) "values" $root.Values.worker) }}
{{- else }}
{{- $seen := dict }}
{{- range $i, $model := $root.Values.models }}
{{- $key := printf "models[%d]" $i }}
{{- $name := toString ($model.name | default "") }}
{{- if or (not $name) (regexMatch "\\s" $name) (gt (len $name) 128) }}
{{- fail (printf "%s.name must be the model's name: no whitespace, 128 characters at most" $key) }}
{{- end }}
{{- /* A DNS label for object names and a label value: lower case, [a-z0-9-]; 52 characters
at most for the StatefulSet, whose pods' controller-revision-hash label adds 11. */}}
{{- $group := regexReplaceAll "[^a-z0-9-]+" (lower $name) "-" | trimAll "-" }}
{{- $fullName := printf "%s-worker-%s" (include "loomserve.fullname" $root) $group | trunc 52 | trimSuffix "-" }}
{{- if not $group }}
{{- fail (printf "%s.name %q has no letter or digit to name its objects by" $key $name) }}
{{- end }}
{{- if hasKey $seen $fullName }}
{{- fail (printf "%s (%s) and %s would share the objects %s: name them apart" $key $name (get $seen $fullName) $fullName) }}
{{- end }}
{{- $_ := set $seen $fullName $key }}
{{- $values := deepCopy $root.Values.worker }}
{{- range $setting, $value := omit $model "name" "file" }}
{{- if not (hasKey $root.Values.worker $setting) }}
{{- fail (printf "%s.%s is no worker setting (name, file, and worker's: %s)" $key $setting (keys $root.Values.worker | sortAlpha | join ", ")) }}
{{- end }}
{{- $base := get $values $setting }}
{{- if and (kindIs "map" $value) (kindIs "map" $base) }}
{{- range $inner, $v := $value }}
{{- if and (kindIs "map" $v) (kindIs "map" (get $base $inner)) }}
{{- $_ := set $base $inner (mustMergeOverwrite (get $base $inner) (deepCopy $v)) }}
{{- else }}
{{- $_ := set $base $inner $v }}
{{- end }}
{{- end }}
{{- else }}
{{- $_ := set $values $setting $value }}
{{- end }}
{{- end }}
{{- $groups = append $groups (dict "name" $name "file" (toString ($model.file | default "")) "group" (trunc 63 $group | trimSuffix "-") "key" $key "fullName" $fullName "values" $values) }}
{{- end }}
{{- end }}
{{- $_ := set .out "groups" $groups }}
{{- end }}

{{/* The LOOMSERVE_* settings that tie a worker group's pods to its Service and model (call
with a group of loomserve.workerGroups), as YAML: they win over the group's env. */}}
{{- define "loomserve.workerWiring" -}}
LOOMSERVE_BIND: {{ printf "tcp://0.0.0.0:%d" (int .values.port) }}
LOOMSERVE_METRICS_HOST: 0.0.0.0
LOOMSERVE_METRICS_PORT: {{ .values.metricsPort | toString | quote }}
{{- with .name }}
LOOMSERVE_SERVED_MODEL_NAME: {{ . | quote }}
{{- end }}
{{- with .file }}
LOOMSERVE_MODEL: {{ . | quote }}
{{- end }}
{{- end }}

{{/* The gateways' LOOMSERVE_WORKER_ENDPOINT: every worker group's headless Service. */}}
{{- define "loomserve.workerEndpoints" -}}
{{- $out := dict }}
{{- include "loomserve.workerGroups" (dict "root" . "out" $out) }}
{{- $endpoints := list }}
{{- range $group := $out.groups }}
{{- $endpoints = append $endpoints (printf "tcp://%s.%s.svc.%s:%d" $group.fullName $.Release.Namespace $.Values.clusterDomain (int $group.values.port)) }}
{{- end }}
{{- join " " $endpoints }}
{{- end }}
