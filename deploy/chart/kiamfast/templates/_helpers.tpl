{{/*
Names, labels, the image, the agent's arguments and its default resources. The checks that
refuse values kiamfast cannot mean the way kube2iam's chart meant them are in _validate.tpl.
*/}}

{{/*
The chart name the objects are named after: kiamfast's own, or with kube2iamChart the kube2iam
chart a release was installed with, so `helm upgrade` of that release names (and selects) its
objects exactly as that chart did and updates them in place.
*/}}
{{- define "kiamfast.chartName" -}}
{{- default .Chart.Name .Values.kube2iamChart -}}
{{- end -}}

{{- define "kiamfast.name" -}}
{{- default (include "kiamfast.chartName" .) .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
kiamfast's own rule: the release name alone when it already contains the chart's name. With
kube2iamChart, the rule of kube2iam's charts (every apps/v1 version of the kube2iam chart,
2.1.0 to 3.2.0, and kube2iam-chart): the name alone only when it *equals* the release name,
else "<release>-<name>"; they have no fullnameOverride (refused then, in _validate.tpl).
*/}}
{{- define "kiamfast.fullname" -}}
{{- if .Values.kube2iamChart -}}
{{- $name := default .Values.kube2iamChart .Values.nameOverride -}}
{{- if eq $name .Release.Name -}}
{{- $name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- else if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "kiamfast.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The agent's container: kube2iam's name after a switch (logs, alerts, `kubectl logs -c`
keep finding it), else kiamfast. */}}
{{- define "kiamfast.containerName" -}}
{{- if .Values.kube2iamChart }}kube2iam{{ else }}kiamfast{{ end -}}
{{- end -}}

{{/* The DaemonSet selector: immutable, so it is exactly what kube2iam's chart selects on. */}}
{{- define "kiamfast.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kiamfast.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kiamfast.labels" -}}
{{ include "kiamfast.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kiamfast
{{- end -}}

{{/* The injection webhook's objects: its Deployment, Service, Secret, Certificate. */}}
{{- define "kiamfast.webhookName" -}}
{{- printf "%s-webhook" (include "kiamfast.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Environment variables from a name -> value map (extraEnv, webhook.extraEnv), sorted by
name, every value a string. */}}
{{- define "kiamfast.env" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}

{{/* The pod annotation naming the role (the agent's --iam-role-key): the webhook's opt-in. */}}
{{- define "kiamfast.iamRoleKey" -}}
{{- index (.Values.extraArgs | default dict) "iam-role-key" | default "iam.amazonaws.com/role" -}}
{{- end -}}

{{/* The ServiceAccount the webhook runs as when it reads ServiceAccounts: its own with
rbac.create (webhook-rbac.yaml), else the one the user grants (rbac.serviceAccountName). */}}
{{- define "kiamfast.webhookServiceAccountName" -}}
{{- if .Values.rbac.create -}}
{{- include "kiamfast.webhookName" . -}}
{{- else -}}
{{- .Values.rbac.serviceAccountName -}}
{{- end -}}
{{- end -}}

{{/* The Secret cert-manager writes the webhook's certificate into (not the chart's own). */}}
{{- define "kiamfast.webhookCertManagerSecret" -}}
{{- include "kiamfast.webhookName" . }}-tls
{{- end -}}

{{- define "kiamfast.serviceAccountName" -}}
{{- if .Values.rbac.create -}}
{{- include "kiamfast.fullname" . -}}
{{- else -}}
{{- .Values.rbac.serviceAccountName -}}
{{- end -}}
{{- end -}}

{{/* Whether image.repository names kube2iam's own published image. */}}
{{- define "kiamfast.isKube2iamImage" -}}
{{- $repo := trimPrefix "docker.io/" .Values.image.repository -}}
{{- if eq (trimPrefix "index.docker.io/" $repo) "jtblin/kube2iam" -}}true{{- end -}}
{{- end -}}

{{- define "kiamfast.defaultRepository" -}}
ghcr.io/kiamfast/kiamfast
{{- end -}}

{{/* image.repository ("" = kiamfast's; kube2iam's is replaced by kiamfast's, its tag with
it) and image.tag ("" = the chart's appVersion), or image.digest. */}}
{{- define "kiamfast.image" -}}
{{- $repo := .Values.image.repository | default (include "kiamfast.defaultRepository" .) -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if include "kiamfast.isKube2iamImage" . -}}
{{- $repo = include "kiamfast.defaultRepository" . -}}
{{- $tag = .Chart.AppVersion -}}
{{- end -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repo .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (toString $tag) -}}
{{- end -}}
{{- end -}}

{{/* The image pull secrets' names: global.imagePullSecrets when set (kube2iam's charts let
it win over image.pullSecrets), else image.pullSecrets. */}}
{{- define "kiamfast.imagePullSecrets" -}}
{{- $secrets := .Values.image.pullSecrets -}}
{{- with .Values.global -}}
{{- with .imagePullSecrets }}{{ $secrets = . }}{{ end -}}
{{- end -}}
{{- toYaml ($secrets | default list) -}}
{{- end -}}

{{- define "kiamfast.metricsPort" -}}
{{- default .Values.host.port .Values.prometheus.metricsPort -}}
{{- end -}}

{{/* The metrics Service's port name: after a switch kube2iam's ("http" when /metrics is on
the app port), so a scrape config naming it keeps finding it; else "metrics". */}}
{{- define "kiamfast.metricsPortName" -}}
{{- if and .Values.kube2iamChart (not .Values.prometheus.metricsPort) }}http{{ else }}metrics{{ end -}}
{{- end -}}

{{/* The directory of the runtime's socket, mounted (not the socket: see deploy/README.md). */}}
{{- define "kiamfast.criDir" -}}
{{- dir .Values.cri.socketPath -}}
{{- end -}}

{{/* The runtime endpoint flag value: the socket in the mounted directory, or none. */}}
{{- define "kiamfast.criEndpoint" -}}
{{- if .Values.cri.enabled -}}
{{- printf "unix://%s" .Values.cri.socketPath -}}
{{- else -}}
none
{{- end -}}
{{- end -}}

{{/*
The container's args, in kube2iam's chart order: the same flags in the same places, so where a
flag is repeated (extraArgs after host-interface/node/host-ip/iptables, before app-port and
metrics-port) the same one wins, the last, as pflag and kiamfast's parser both take it.
kiamfast's own flags come last.
*/}}
{{- define "kiamfast.args" -}}
- --host-interface={{ .Values.host.interface }}
- --node=$(NODE_NAME)
{{- if .Values.host.ip }}
- --host-ip={{ .Values.host.ip }}
{{- end }}
- --iptables={{ .Values.host.iptables }}
{{- range $key, $value := .Values.extraArgs }}
{{- if or (kindIs "invalid" $value) (eq (toString $value) "") }}
- --{{ $key }}
{{- else }}
- --{{ $key }}={{ $value }}
{{- end }}
{{- end }}
{{- if .Values.verbose }}
- --verbose
{{- end }}
- --app-port={{ .Values.host.port }}
- --metrics-port={{ include "kiamfast.metricsPort" . }}
- --workers={{ .Values.workers }}
{{- if .Values.realtimeWorkers }}
- --worker-realtime
{{- end }}
- --node-startup-taint={{ .Values.startupTaint.key }}
- --cri-endpoint={{ include "kiamfast.criEndpoint" . }}
- --table-path={{ .Values.stateDir }}/table
- --token-key-file={{ .Values.stateDir }}/token-key
- --handover-socket={{ .Values.stateDir }}/handover.sock
{{- if .Values.handoverPort }}
- --handover-port={{ .Values.handoverPort }}
{{- end }}
- --ready-file={{ include "kiamfast.readyFile" . }}
{{- if .Values.socketKeeper.enabled }}
- --socket-keeper={{ include "kiamfast.keeperSocket" . }}
{{- end }}
{{- if .Values.host.iptables }}
{{- if .Values.dnatRule.backstop }}
- --iptables-backstop
{{- end }}
- --iptables-check-interval={{ .Values.dnatRule.checkInterval }}
{{- if .Values.dnatRule.removeOnUninstall }}
- --iptables-remove-on-uninstall
- --pod-name=$(POD_NAME)
- --pod-namespace=$(POD_NAMESPACE)
{{- end }}
{{- end }}
{{- with .Values.containerCredentials }}
{{- if .enabled }}
- --container-credentials-addr={{ include "kiamfast.containerCredentialsAddr" $ }}
{{- with .link }}
- --container-credentials-link={{ . }}
{{- end }}
- --container-credentials-audience={{ .audience }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
containerCredentials keys added after the chart first had containerCredentials.webhook.
`helm upgrade --reuse-values` renders with the installed release's values.yaml, not this
one, so a key added since is missing there: it is set here, to the default values.yaml
gives it (tests/deploy/test_chart_container_credentials.py checks the two agree). Run first
by kiamfast.validate, which every template includes first; it is idempotent.
*/}}
{{- define "kiamfast.containerCredentialsDefaults" -}}
{{- $cc := .Values.containerCredentials -}}
{{- range $key, $value := dict "enabled" false "ipv6" true "link" "kiamfast0" "audience" "kiamfast.io/container-credentials" -}}
{{- if not (hasKey $cc $key) }}{{ $_ := set $cc $key $value }}{{ end -}}
{{- end -}}
{{- $webhook := $cc.webhook -}}
{{- range $key, $value := dict "uriFamily" "ipv4" "certManager" (dict "enabled" false "issuerRef" (dict)) "serviceAccountOptIn" true "extraEnv" (dict) "networkPolicy" (dict "enabled" false "apiServerCIDRs" (list)) -}}
{{- if not (hasKey $webhook $key) }}{{ $_ := set $webhook $key $value }}{{ end -}}
{{- end -}}
{{- end -}}

{{/*
Where the agent serves container credentials: the EKS Pod Identity addresses the SDKs accept
for http://, port 80. The webhook's injected URI names the IPv4 one (every SDK takes it), or
the IPv6 one for IPv6-only pods (webhook.uriFamily).
*/}}
{{- define "kiamfast.containerCredentialsIP" -}}
169.254.170.23
{{- end -}}

{{- define "kiamfast.containerCredentialsAddr" -}}
{{- include "kiamfast.containerCredentialsIP" . }}:80
{{- if .Values.containerCredentials.ipv6 }},[fd00:ec2::23]:80{{ end }}
{{- end -}}

{{- define "kiamfast.containerCredentialsURI" -}}
{{- if eq .Values.containerCredentials.webhook.uriFamily "ipv6" -}}
http://[fd00:ec2::23]/v1/credentials
{{- else -}}
http://{{ include "kiamfast.containerCredentialsIP" . }}/v1/credentials
{{- end -}}
{{- end -}}

{{/* The memory the agent needs, from the measured RSS (values.yaml, resources). */}}
{{- define "kiamfast.minimumMemoryMi" -}}
{{- add 128 (mul 32 (int .Values.workers)) -}}
{{- end -}}

{{/* The default resources: small requests, so a surge pod fits beside the old one without
preempting a workload; the limit from the measured RSS (values.yaml, resources). */}}
{{- define "kiamfast.resources" -}}
{{- if .Values.resources -}}
{{- toYaml .Values.resources -}}
{{- else -}}
requests:
  cpu: 20m
  memory: 64Mi
# No CPU limit: a throttled agent makes the SDKs' 1 s metadata calls time out.
limits:
  memory: {{ mul 2 (int (include "kiamfast.minimumMemoryMi" .)) }}Mi
{{- end -}}
{{- end -}}

{{/* The pod's own directory (an emptyDir): the ready file, the socket keeper's socket. */}}
{{- define "kiamfast.podDir" -}}
/run/kiamfast-pod
{{- end -}}

{{- define "kiamfast.readyFile" -}}
{{ include "kiamfast.podDir" . }}/ready
{{- end -}}

{{- define "kiamfast.keeperSocket" -}}
{{ include "kiamfast.podDir" . }}/keeper.sock
{{- end -}}

{{/* The numeric part of a number or percentage (maxSurge, maxUnavailable). */}}
{{- define "kiamfast.intOrPercentValue" -}}
{{- trimSuffix "%" (toString .) | int -}}
{{- end -}}

{{/* "true" when a RollingUpdate (the string form) surges: maxUnavailable 0 (kiamfast's
default); a kube2iam values file's maxUnavailable other than 0 rolls without the surge. */}}
{{- define "kiamfast.surging" -}}
{{- if and (eq (toString .Values.updateStrategy) "RollingUpdate") (eq (include "kiamfast.intOrPercentValue" .Values.maxUnavailable) "0") -}}
true
{{- end -}}
{{- end -}}

{{/*
Values added with the handover. `helm upgrade --reuse-values` renders with the installed
release's values.yaml, not this one, so a key added since is missing there: it is set here
to the default values.yaml gives it (tests/deploy/test_chart_handover.py checks the two
agree). maxUnavailable is not: a release installed before has its own (1), which keeps
rolling it without the surge. Run first by kiamfast.validate; idempotent.
*/}}
{{- define "kiamfast.handoverDefaults" -}}
{{- range $key, $value := dict "maxSurge" "10%" "handoverPort" 8182 "socketKeeper" (dict "enabled" true "resources" (dict "requests" (dict "cpu" "1m" "memory" "8Mi") "limits" (dict "memory" "32Mi"))) "dnatRule" (dict "checkInterval" "10s" "backstop" true) -}}
{{- if not (hasKey $.Values $key) }}{{ $_ := set $.Values $key $value }}{{ end -}}
{{- end -}}
{{- if not (hasKey .Values.dnatRule "removeOnUninstall") }}{{ $_ := set .Values.dnatRule "removeOnUninstall" true }}{{ end -}}
{{- end -}}
