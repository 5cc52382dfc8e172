{{/* TEST DATA: the kube2iam chart's naming rule, written for the tests (README.md). */}}
{{- define "fixture.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fixture.fullname" -}}
{{- $name := .Values.nameOverride | default .Chart.Name -}}
{{- $full := ternary $name (printf "%s-%s" .Release.Name $name) (eq $name .Release.Name) -}}
{{- $full | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fixture.selector" -}}
app.kubernetes.io/name: {{ include "fixture.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "fixture.labels" -}}
{{ include "fixture.selector" . }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}
