{{/*
The install notes, a template of their own so tests can render them with `helm template`
(which prints no NOTES.txt).
*/}}
{{- define "kiamfast.notes" -}}
kiamfast runs on every node as DaemonSet {{ .Release.Namespace }}/{{ include "kiamfast.fullname" . }}.

Ready agents (their DNAT rule installed, their node's pods and credentials loaded):

  kubectl --namespace {{ .Release.Namespace }} get pods -l app.kubernetes.io/instance={{ .Release.Name }},app.kubernetes.io/name={{ include "kiamfast.name" . }}

From a pod annotated iam.amazonaws.com/role=<role>:

  curl -s http://169.254.169.254/latest/meta-data/iam/security-credentials/
{{- if not .Values.host.iptables }}

NOTE: host.iptables is false: no DNAT rule is installed, so pods still reach the node's real
metadata service (and the node's role) unless something else redirects them.
{{- end }}
{{- if and .Release.IsInstall (not .Values.kube2iamChart) (or (contains "kube2iam" .Release.Name) (include "kiamfast.isKube2iamImage" .)) }}

NOTE: a new release beside kube2iam? kube2iam's pods hold port {{ .Values.host.port }} on their nodes, so this
release's pods start there only once those are gone. To switch a kube2iam release in place,
upgrade that release with kube2iamChart set instead (deploy/README.md, "Switching from kube2iam").
{{- end }}
{{- $strategy := .Values.updateStrategy }}
{{- if kindIs "map" $strategy }}{{ $strategy = get $strategy "type" }}{{ end }}
{{- if eq $strategy "OnDelete" }}

NOTE: updateStrategy is OnDelete (kube2iam's charts' default, kept because your values say so):
an upgrade replaces no pod by itself, so each node keeps its old pod{{ if .Values.kube2iamChart }} (after the switch:
kube2iam){{ end }} until you delete it. Roll the nodes one at a time, each once the last one's new pod is Ready:

  kubectl --namespace {{ .Release.Namespace }} delete pod --field-selector spec.nodeName=<node> -l app.kubernetes.io/instance={{ .Release.Name }},app.kubernetes.io/name={{ include "kiamfast.name" . }}
  kubectl --namespace {{ .Release.Namespace }} get pods -o wide -l app.kubernetes.io/instance={{ .Release.Name }},app.kubernetes.io/name={{ include "kiamfast.name" . }}

The node's pods are refused between the old pod's stop and the new one's start. Or leave
updateStrategy out of your values: kiamfast's default rolls the nodes for you, each new pod
taking its node over from the old one without a refused call (docs/upgrade-and-rollback.md).
{{- else if and (eq (toString $strategy) "RollingUpdate") (not (kindIs "map" .Values.updateStrategy)) (not (include "kiamfast.surging" .)) }}

NOTE: maxUnavailable is {{ .Values.maxUnavailable }} (kube2iam's charts' way, kept because your values say so): on
each node the old pod stops before the new one starts, and the node's pods are refused for the
seconds between. Leave maxUnavailable out of your values (or set it to 0) for kiamfast's
surge: each node's new pod takes the node over from the old one without a refused call.
{{- else if and .Values.kube2iamChart (include "kiamfast.surging" .) }}

The switch from kube2iam: on each node kiamfast's pod starts beside kube2iam's, serves on port
{{ .Values.handoverPort }} and takes pods' new connections from kube2iam with a DNAT rule of its own; once
it is Ready the DaemonSet deletes kube2iam's pod and kiamfast moves back to port {{ .Values.host.port }}.
{{- end }}
{{- if include "kiamfast.isKube2iamImage" . }}

NOTE: image.repository {{ .Values.image.repository }} is kube2iam's image; running
{{ include "kiamfast.image" . }} instead.
{{- end }}
{{- if hasPrefix (printf "%s:" (include "kiamfast.defaultRepository" .)) (include "kiamfast.image" .) }}

NOTE: {{ include "kiamfast.image" . }} is not published: until it is in a registry your nodes
pull from, the agent's pods stay in ImagePullBackOff{{ if .Values.kube2iamChart }} and each node keeps its old pod{{ end }}.
Publish it (deploy/release.sh; docs/install.md, "1. Get the image") and set image.repository.
{{- end }}
{{- if .Values.podSecurityPolicy.enabled }}

NOTE: podSecurityPolicy.* is ignored: PodSecurityPolicy was removed in Kubernetes 1.25. The
agent needs hostNetwork, root and the NET_ADMIN and NET_RAW capabilities{{ if .Values.cri.enabled }} (and NET_BROADCAST){{ end }}, and hostPath mounts of {{ .Values.stateDir }}{{ if .Values.cri.enabled }}, {{ include "kiamfast.criDir" . }} and {{ .Values.cri.netnsDir }}{{ end }}: label the namespace for the privileged Pod Security level.
{{- end }}
{{- if not .Values.rbac.create }}

NOTE: rbac.create is false: the ServiceAccount "{{ .Values.rbac.serviceAccountName }}" needs get, list, watch
on pods and namespaces and get, patch on nodes (for the startup taint){{ if .Values.containerCredentials.enabled }},
and create on tokenreviews.authentication.k8s.io and on events (for container credentials){{ end }}
{{- with .Values.containerCredentials.webhook }}{{ if and .enabled .serviceAccountOptIn }};
the injection webhook runs as it too and needs get on serviceaccounts (the opt-in by ServiceAccount){{ end }}{{ end }}.
{{- end }}
{{- with .Values.containerCredentials }}
{{- if .enabled }}

Container credentials: the agents serve {{ include "kiamfast.containerCredentialsURI" $ }}.
{{- if .webhook.enabled }} A pod opts in with
the annotations {{ include "kiamfast.iamRoleKey" $ }}=<role> and kiamfast.io/container-credentials="true"
{{- if .webhook.serviceAccountOptIn }}
on itself or on its ServiceAccount (the pod's own annotations win; "false" on a pod opts it out)
{{- end }}
(pods created while the webhook is down, or cannot read their ServiceAccount, are not injected
and use IMDS by address).
{{- if .webhook.certManager.enabled }}
Its certificate comes from cert-manager, which must be installed: the webhook's pods start once
cert-manager has written the Secret {{ include "kiamfast.webhookCertManagerSecret" $ }}.
{{- end }}
{{- else }} Without the webhook,
give a pod AWS_CONTAINER_CREDENTIALS_FULL_URI and a projected token with audience {{ .audience }}
(deploy/README.md, "Container credentials").
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.startupTaint.key .Values.startupTaint.tolerate }}

Register new nodes with the taint {{ .Values.startupTaint.key }}=true:NoExecute: the agent removes it
once it is ready, so no pod starts on a node before its agent serves.
{{- end }}
{{- with .Values.lifecycle }}
{{- with .preStop }}
{{- if contains "169.254.169.254" (toYaml .) }}

WARNING: lifecycle.preStop deletes the metadata DNAT rule (kube2iam's chart did). Between an
agent stopping and the next one starting, pods then reach the node's own role. kiamfast keeps
the rule on purpose; remove lifecycle from your values (or, to remove the rule on exit anyway,
use extraArgs.iptables-remove-on-exit: true).
{{- end }}
{{- end }}
{{- end }}
{{- with .Values.resources }}
{{- with .limits }}
{{- if .cpu }}

WARNING: resources.limits.cpu is set: a throttled agent makes the SDKs' metadata calls time out.
{{- end }}
{{- end }}
{{- end }}
{{- end -}}
