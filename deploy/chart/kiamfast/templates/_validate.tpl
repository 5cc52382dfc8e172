{{/*
The checks of what values mean. Names and types are values.schema.json's, which helm checks
before any template runs (every misspelt key and every value of the wrong type, in one
error). What a schema cannot say is checked here: every value kiamfast cannot mean the way
kube2iam's chart meant it, and every combination that cannot work, each a line naming the
value and why. "kiamfast.problems" writes those lines; "kiamfast.validate" fails with all of
them at once. templates/validate/values.yaml runs it first (helm renders the deepest
templates first), so the error names that template; every other template includes it too,
so none renders from values that fail.
*/}}

{{/*
kiamfast's flags (`kiamfast --help`), booleans and the others, so a mistyped or unknown flag
in extraArgs fails the render instead of the agent's start. tests/deploy/test_chart.py keeps
these lists equal to the CLI's flag table (--version excepted: it stops the agent).
*/}}
{{- define "kiamfast.boolFlags" -}}
debug insecure iptables auto-discover-base-arn auto-discover-default-role
namespace-restrictions resolve-duplicate-cache-ips use-regional-sts-endpoint verbose
kubelet-insecure session-tags iptables-remove-on-exit metadata-ipv6 iptables-backstop
iptables-remove-on-uninstall worker-realtime
{{- end -}}

{{- define "kiamfast.valueFlags" -}}
kubeconfig api-server api-token app-port metrics-port base-role-arn default-role
iam-role-key iam-external-id iam-role-session-ttl iam-role-error-ttl metadata-addr
host-interface namespace-restriction-format namespace-key cache-resync-period host-ip node
backoff-max-interval backoff-max-elapsed-time log-format log-level workers wait-budget
imdsv2 token-key-file cri-endpoint kubelet-url sts-endpoint sts-region sts-qps sts-burst
session-duration min-credential-lifetime session-name-policy node-startup-taint
iptables-backend namespace-permitted-key table-path ready-prefetch-timeout host-ipv6
listen-host passthrough-qps passthrough-burst passthrough-concurrency sts-account-qps
sts-fleet-nodes container-credentials-addr container-credentials-audience session-tag-keys
cluster-name container-credentials-link socket-keeper handover-socket handover-port ready-file
iptables-check-interval address-proof pod-name pod-namespace
{{- end -}}

{{/* A memory quantity in MiB (whole units only: Ki Mi Gi Ti, k M G T, or bytes); -1 for
one it does not understand. */}}
{{- define "kiamfast.mebibytes" -}}
{{- $q := toString . -}}
{{- $units := dict "Ki" 0.0009765625 "Mi" 1.0 "Gi" 1024.0 "Ti" 1048576.0 "k" 0.00095367431640625 "M" 0.95367431640625 "G" 953.67431640625 "T" 953674.31640625 "" 0.00000095367431640625 -}}
{{- $unit := regexFind "[A-Za-z]+$" $q -}}
{{- $number := trimSuffix $unit $q -}}
{{- if not (and (hasKey $units $unit) (regexMatch "^[0-9]+(\\.[0-9]+)?$" $number)) -}}
-1
{{- else -}}
{{- mulf (float64 $number) (get $units $unit) | floor | int -}}
{{- end -}}
{{- end -}}

{{/*
The defaults an older release's values lack, then every problem at once, or nothing.
*/}}
{{- define "kiamfast.validate" -}}
{{- include "kiamfast.containerCredentialsDefaults" . -}}
{{- include "kiamfast.handoverDefaults" . -}}
{{- include "kiamfast.kube2iamProbe" . -}}
{{- $problems := include "kiamfast.problems" . | trim -}}
{{- if $problems -}}
{{- $lines := splitList "\n" $problems -}}
{{- fail (printf "%d value problem%s, each with the reason (values.yaml explains every value):\n- %s" (len $lines) (ternary "" "s" (eq (len $lines) 1)) (join "\n- " $lines)) -}}
{{- end -}}
{{- end -}}

{{/*
One line for each value kiamfast cannot mean the way kube2iam's chart did, or that cannot
work with the others; nothing when all is well.
*/}}
{{- define "kiamfast.problems" -}}
{{- $boolFlags := include "kiamfast.boolFlags" . | splitList "\n" | join " " | splitList " " -}}
{{- $valueFlags := include "kiamfast.valueFlags" . | splitList "\n" | join " " | splitList " " -}}
{{- range $key, $value := .Values.extraArgs -}}
{{- if not (or (has $key $boolFlags) (has $key $valueFlags)) -}}
{{- printf "extraArgs.%s: kiamfast has no flag --%s for a running agent (python -m kiamfast --help lists them; every kube2iam flag is one)\n" $key $key -}}
{{- end -}}
{{- if and (has $key $valueFlags) (or (kindIs "invalid" $value) (eq (toString $value) "")) -}}
{{- printf "extraArgs.%s: empty: a bare --%s takes the next argument as its value (in kube2iam too); give it a value\n" $key $key -}}
{{- end -}}
{{- if or (and (kindIs "bool" $value) (not $value)) (and (or (kindIs "float64" $value) (kindIs "int64" $value) (kindIs "int" $value)) (eq (float64 $value) 0.0)) -}}
{{- printf "extraArgs.%s: %v: kube2iam's chart renders this as a bare --%s, which switches a boolean ON; kiamfast will not guess which you meant: write %s: true, or remove the key to keep the flag's default\n" $key $value $key $key -}}
{{- end -}}
{{- $owned := dict "workers" "workers" "node-startup-taint" "startupTaint.key" "cri-endpoint" "cri.enabled and cri.socketPath" "table-path" "stateDir" "token-key-file" "stateDir" "container-credentials-addr" "containerCredentials.enabled and containerCredentials.ipv6" "container-credentials-link" "containerCredentials.link" "container-credentials-audience" "containerCredentials.audience" "handover-socket" "stateDir" "handover-port" "handoverPort" "socket-keeper" "socketKeeper.enabled" "ready-file" "readinessProbe" "iptables-backstop" "dnatRule.backstop" "iptables-check-interval" "dnatRule.checkInterval" "iptables-remove-on-uninstall" "dnatRule.removeOnUninstall" "worker-realtime" "realtimeWorkers" -}}
{{- if hasKey $owned $key -}}
{{- printf "extraArgs.%s: the chart sets --%s from its own value (%s); set that instead\n" $key $key (get $owned $key) -}}
{{- end -}}
{{- end -}}
{{- include "kiamfast.validateContainerCredentials" . -}}
{{- if and .Values.host.iptables (not .Values.host.ip) -}}
{{- print "host.iptables: the DNAT rule needs host.ip (the node's address, $(HOST_IP))\n" -}}
{{- end -}}
{{- if and (not .Values.existingSecret) (or .Values.aws.access_key .Values.aws.secret_key) (not (and .Values.aws.access_key .Values.aws.secret_key)) -}}
{{- print "aws.access_key and aws.secret_key: set both or neither (kube2iam's chart silently used neither when one was missing)\n" -}}
{{- end -}}
{{- $repo := trimPrefix "docker.io/" .Values.image.repository -}}
{{- if and (not (include "kiamfast.isKube2iamImage" .)) (or (eq $repo "kube2iam") (hasSuffix "/kube2iam" $repo)) -}}
{{- printf "image.repository %s: looks like a mirror of kube2iam's image, which would run kube2iam, not kiamfast; point it at your mirror of ghcr.io/kiamfast/kiamfast\n" .Values.image.repository -}}
{{- end -}}
{{- include "kiamfast.validateKube2iamChart" . -}}
{{- $workers := .Values.workers -}}
{{- if not (and (ge (int $workers) 1) (le (int $workers) 64)) -}}
{{- printf "workers: %v: a number of worker processes from 1 to 64\n" $workers -}}
{{- end -}}
{{- if and .Values.cri.enabled (not (hasPrefix "/" (toString .Values.cri.socketPath))) -}}
{{- printf "cri.socketPath %q: an absolute path of the runtime's socket on the node\n" (toString .Values.cri.socketPath) -}}
{{- end -}}
{{- if and .Values.cri.enabled (eq (include "kiamfast.criDir" .) "/") -}}
{{- printf "cri.socketPath %q: the chart mounts the socket's directory, and / is the whole node; use the runtime's own directory\n" (toString .Values.cri.socketPath) -}}
{{- end -}}
{{- if not (regexMatch "^/[^/]" (toString .Values.stateDir)) -}}
{{- printf "stateDir %q: an absolute directory on the node, not /, for the agent's table and token key\n" (toString .Values.stateDir) -}}
{{- end -}}
{{- with .Values.resources -}}
{{- with .limits -}}
{{- with .memory -}}
{{- $need := int (include "kiamfast.minimumMemoryMi" $) -}}
{{- $given := int (include "kiamfast.mebibytes" .) -}}
{{- if lt $given 0 -}}
{{- printf "resources.limits.memory %v: kiamfast's chart understands whole numbers with Ki, Mi, Gi, Ti, k, M, G, T or no suffix\n" . -}}
{{- else if lt $given $need -}}
{{- printf "resources.limits.memory %v: kiamfast needs at least %dMi with %v worker(s) (about twice what it was measured to use: 72-76 MiB at 250 pods with one worker, 16-18 MiB more per worker, the shared table in memory counted against the limit; docs/install.md, Sizing); kube2iam, one Go process, fit in less\n" . $need $.Values.workers -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (kindIs "string" .Values.updateStrategy) (not (has .Values.updateStrategy (list "RollingUpdate" "OnDelete"))) -}}
{{- printf "updateStrategy %s: a DaemonSet updates by RollingUpdate or OnDelete\n" .Values.updateStrategy -}}
{{- end -}}
{{- include "kiamfast.validateHandover" . -}}
{{- end -}}

{{/*
The rollout and the handover (docs/upgrade-and-rollback.md): maxSurge, maxUnavailable,
handoverPort, socketKeeper, dnatRule, and the readiness probe's ready file.
*/}}
{{- define "kiamfast.validateHandover" -}}
{{- range $key := list "maxSurge" "maxUnavailable" -}}
{{- $value := toString (get $.Values $key) -}}
{{- if not (regexMatch "^[0-9]+%?$" $value) -}}
{{- printf "%s %s: a number of nodes or a percentage of them, e.g. 1 or 10%%\n" $key $value -}}
{{- end -}}
{{- if and (hasSuffix "%" $value) (gt (int (trimSuffix "%" $value)) 100) -}}
{{- printf "%s %s: a percentage of the nodes, at most 100%%\n" $key $value -}}
{{- end -}}
{{- end -}}
{{- if and (eq (toString .Values.updateStrategy) "RollingUpdate") (include "kiamfast.surging" .) (eq (include "kiamfast.intOrPercentValue" .Values.maxSurge) "0") -}}
{{- print "maxSurge and maxUnavailable are both 0: a RollingUpdate needs one of them (maxSurge: the surge handover, kiamfast's default 10%; or maxUnavailable: a node's old pod stops first)\n" -}}
{{- end -}}
{{- with .Values.updateStrategy -}}
{{- if and (kindIs "map" .) (hasKey . "rollingUpdate") -}}
{{- $rolling := .rollingUpdate | default dict -}}
{{- if and (hasKey $rolling "maxSurge") (ne (include "kiamfast.intOrPercentValue" $rolling.maxSurge) "0") (not (hasKey $rolling "maxUnavailable")) -}}
{{- print "updateStrategy.rollingUpdate.maxSurge needs maxUnavailable: 0 beside it: the API defaults maxUnavailable to 1 and refuses both non-zero\n" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $port := .Values.handoverPort -}}
{{- if not (and (ge (int $port) 0) (le (int $port) 65535)) -}}
{{- printf "handoverPort %v: a port number, or 0 for none\n" $port -}}
{{- end -}}
{{- if and (int $port) (has (int $port) (list (int .Values.host.port) (int (include "kiamfast.metricsPort" .)))) -}}
{{- printf "handoverPort %v: the second port must differ from host.port and the metrics port\n" $port -}}
{{- end -}}
{{- if and .Values.kube2iamChart (include "kiamfast.surging" .) (not (int $port)) -}}
{{- print "handoverPort 0 with kube2iamChart and the surge: kube2iam cannot hand its port over, so each node's new pod needs the second port to start beside it (or set maxUnavailable: 1)\n" -}}
{{- end -}}
{{- if not (regexMatch "^(0|([0-9]+(\\.[0-9]+)?(ns|us|ms|s|m|h))+)$" (toString .Values.dnatRule.checkInterval)) -}}
{{- printf "dnatRule.checkInterval %v: a duration such as 10s (Go's form), or 0 to install the rule once\n" .Values.dnatRule.checkInterval -}}
{{- end -}}
{{- with .Values.readinessProbe.path -}}
{{- if ne . "/readyz" -}}
{{- printf "readinessProbe.path %s: the readiness probe is no HTTP request any more but the agent's own ready file (test -f), since during a handover two pods serve one port; remove it\n" . -}}
{{- end -}}
{{- end -}}
{{- $podDir := include "kiamfast.podDir" . -}}
{{- if or (eq (toString .Values.stateDir) $podDir) (hasPrefix (printf "%s/" (trimSuffix "/" (toString .Values.stateDir))) $podDir) -}}
{{- printf "stateDir %s: %s is the pod's own directory (an emptyDir): choose another node directory\n" .Values.stateDir $podDir -}}
{{- end -}}
{{- end -}}

{{/* containerCredentials: the agent's listener and the webhook that sends pods to it. */}}
{{- define "kiamfast.validateContainerCredentials" -}}
{{- $cc := .Values.containerCredentials -}}
{{- if and $cc.webhook.enabled (not $cc.enabled) -}}
{{- print "containerCredentials.webhook.enabled needs containerCredentials.enabled: injected pods would send their SDK to 169.254.170.23, which no agent would serve, and the SDKs do not fall back to IMDS\n" -}}
{{- end -}}
{{- if not (has $cc.webhook.uriFamily (list "ipv4" "ipv6")) -}}
{{- printf "containerCredentials.webhook.uriFamily %v: ipv4 (http://169.254.170.23) or ipv6 (http://[fd00:ec2::23], for IPv6-only pods)\n" $cc.webhook.uriFamily -}}
{{- end -}}
{{- if and $cc.webhook.enabled (eq $cc.webhook.uriFamily "ipv6") (not $cc.ipv6) -}}
{{- print "containerCredentials.webhook.uriFamily ipv6 needs containerCredentials.ipv6: injected pods would ask [fd00:ec2::23], where no agent would listen\n" -}}
{{- end -}}
{{- if and $cc.enabled (not $cc.audience) -}}
{{- print "containerCredentials.audience: empty: a projected token without an audience is one for the API server itself; name kiamfast's (default kiamfast.io/container-credentials)\n" -}}
{{- end -}}
{{- if and $cc.webhook.enabled (lt (int $cc.webhook.tokenExpirationSeconds) 600) -}}
{{- printf "containerCredentials.webhook.tokenExpirationSeconds %v: at least 600 (the TokenRequest API's minimum)\n" $cc.webhook.tokenExpirationSeconds -}}
{{- end -}}
{{- with $cc.webhook.networkPolicy -}}
{{- if and .enabled (or (not (kindIs "slice" .apiServerCIDRs)) (not .apiServerCIDRs)) -}}
{{- print "containerCredentials.webhook.networkPolicy.enabled needs apiServerCIDRs: the API server's source addresses as CIDRs, e.g. [10.0.0.0/16] (a rule without sources would admit every pod)\n" -}}
{{- end -}}
{{- end -}}
{{- with $cc.webhook.certManager.issuerRef -}}
{{- if not (and (kindIs "map" .) (kindIs "string" .name) .name) -}}
{{- print "containerCredentials.webhook.certManager.issuerRef: {} (the chart makes its own CA issuer) or a cert-manager issuerRef with a name, e.g. {name: my-ca, kind: ClusterIssuer}\n" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
probe, the kube2iam chart's liveness probe before 3.0.0 (its 2.x had no readiness probe):
true/false up to 2.5.0 (the probe at fixed timings), a map from 2.5.1 on (enabled and the
timings, defaulting to those). It means that here: it sets livenessProbe, and wins over it.
(Its form, true/false or that map, is the schema's to check.)
*/}}
{{- define "kiamfast.kube2iamProbe" -}}
{{- if hasKey .Values "probe" -}}
{{- $probe := .Values.probe -}}
{{- $timings := dict "enabled" true "initialDelaySeconds" 30 "periodSeconds" 5 "successThreshold" 1 "failureThreshold" 3 "timeoutSeconds" 1 -}}
{{- if kindIs "bool" $probe -}}
{{- $probe = dict "enabled" $probe -}}
{{- end -}}
{{- range $key, $default := $timings -}}
{{- $_ := set $.Values.livenessProbe $key (hasKey $probe $key | ternary (get $probe $key) $default) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
kube2iamChart, the switch from a kube2iam chart's release: the objects keep that chart's names
(see kiamfast.fullname), and a line for each value that would mean something else after a
switch.
*/}}
{{- define "kiamfast.validateKube2iamChart" -}}
{{- with .Values.kube2iamChart -}}
{{- if not (has . (list "kube2iam" "kube2iam-chart")) -}}
{{- printf "kube2iamChart %v: the chart your kube2iam release was installed with, kube2iam or kube2iam-chart (helm list, CHART without its version)\n" . -}}
{{- end -}}
{{- if $.Values.fullnameOverride -}}
{{- printf "fullnameOverride %v: kube2iam's charts have no such value (they named the DaemonSet after the release); with kube2iamChart the names are theirs, so remove it\n" $.Values.fullnameOverride -}}
{{- end -}}
{{- if and $.Values.image.tag (not $.Values.image.repository) (not $.Values.image.digest) -}}
{{- printf "image.tag %v without image.repository: in kube2iam's chart that ran jtblin/kube2iam:%v; kube2iam's and kiamfast's version numbers overlap, so the chart cannot tell which you mean: remove image.tag (kiamfast %s, this chart's version) or name the repository too\n" $.Values.image.tag $.Values.image.tag $.Chart.AppVersion -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
An upgrade that would replace the release's DaemonSet rather than update it: helm would create
the new one beside the old (both want host.port on every node) and delete the old one only
after. Only `helm upgrade` against a cluster looks (`helm template` and GitOps renders see no
cluster and render from the values alone); it refuses, naming the value that keeps the name.
*/}}
{{- define "kiamfast.validateInPlace" -}}
{{- $name := include "kiamfast.fullname" . -}}
{{- $selector := include "kiamfast.selectorLabels" . | fromYaml -}}
{{- range (lookup "apps/v1" "DaemonSet" .Release.Namespace "").items | default list -}}
{{- $release := dig "metadata" "annotations" "meta.helm.sh/release-name" "" . -}}
{{- if and (eq $release $.Release.Name) (or (ne .metadata.name $name) (not (deepEqual .spec.selector.matchLabels $selector))) -}}
{{- $chart := dig "metadata" "labels" "helm.sh/chart" "" . -}}
{{- $hint := "set nameOverride so the names match" -}}
{{- if hasPrefix "kube2iam-chart-" $chart -}}
{{- $hint = "set kube2iamChart=kube2iam-chart (deploy/README.md, Switching from kube2iam)" -}}
{{- else if hasPrefix "kube2iam-" $chart -}}
{{- $hint = "set kube2iamChart=kube2iam (deploy/README.md, Switching from kube2iam)" -}}
{{- end -}}
{{- fail (printf "DaemonSet %s/%s of release %s (chart %s) would be replaced by %s, started beside it (both want port %v on every node): to update it in place, %s" .metadata.namespace .metadata.name $.Release.Name (default "unknown" $chart) $name $.Values.host.port $hint) -}}
{{- end -}}
{{- end -}}
{{- end -}}
