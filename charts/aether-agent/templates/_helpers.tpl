{{/* Names and labels shared by every object of the release. */}}

{{- define "aether-agent.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "aether-agent.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "aether-agent.proxyName" -}}
{{- printf "%s-proxy" (include "aether-agent.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "aether-agent.keeperName" -}}
{{- printf "%s-keeper" (include "aether-agent.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "aether-agent.registrarName" -}}
{{- printf "%s-registrar" (include "aether-agent.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The agent's registrar: agent.registrar, else the chart's registrar Service when enabled. */}}
{{- define "aether-agent.registrarAddress" -}}
{{- if .Values.agent.registrar -}}
{{- .Values.agent.registrar -}}
{{- else if .Values.registrar.enabled -}}
{{- printf "%s.%s.svc:%d" (include "aether-agent.registrarName" .) .Release.Namespace (int .Values.registrar.port) -}}
{{- end -}}
{{- end -}}

{{- define "aether-agent.serviceAccountName" -}}
{{- default (include "aether-agent.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "aether-agent.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "aether-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels; component is "agent" or "proxy". Immutable once installed. */}}
{{- define "aether-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "aether-agent.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "aether-agent.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The agent's run folder: a contract (DESIGN.md), shared with the proxy, not a value. */}}
{{- define "aether-agent.runDir" -}}/run/aether{{- end -}}
{{- define "aether-agent.stateDir" -}}/var/lib/aether{{- end -}}

{{/*
The Envoy bootstrap: the project's one template, deploy/envoy/bootstrap.yaml.tmpl (linked
as files/envoy-bootstrap.yaml.tmpl), whose envsubst-style placeholders are filled here. Its
full-line comments (the placeholder list) are dropped. ENVOY_NODE_ID gets a stand-in: one
ConfigMap serves every node, and the proxy container sets the real id, the node name, with
--service-node $(NODE_NAME), which overrides node.id. Rendering fails if the template
grows a placeholder this chart does not fill.
*/}}
{{- define "aether-agent.envoyBootstrap" -}}
{{- $t := .Files.Get "files/envoy-bootstrap.yaml.tmpl" -}}
{{- if not $t -}}
{{- fail "files/envoy-bootstrap.yaml.tmpl is missing or empty (a link to deploy/envoy/bootstrap.yaml.tmpl)" -}}
{{- end -}}
{{- $admin := printf "{ socket_address: { address: 127.0.0.1, port_value: %d } }" (int .Values.proxy.adminPort) -}}
{{- $t = regexReplaceAll "(?m)^[ \t]*#.*\n" $t "" -}}
{{- $t = $t | replace "${AETHER_RUN_DIR}" (include "aether-agent.runDir" .) -}}
{{- $t = $t | replace "${ENVOY_ADMIN_ADDRESS}" $admin -}}
{{- $t = $t | replace "${ENVOY_NODE_ID}" "set-by-service-node-flag" -}}
{{- $t = $t | replace "${ADS_BACKOFF_BASE}" .Values.proxy.backoff.base -}}
{{- $t = $t | replace "${ADS_BACKOFF_MAX}" .Values.proxy.backoff.max -}}
{{- if not (has .Values.proxy.adsApiType (list "GRPC" "DELTA_GRPC")) -}}
{{- fail (printf "proxy.adsApiType is %q; it must be GRPC or DELTA_GRPC" .Values.proxy.adsApiType) -}}
{{- end -}}
{{- $t = $t | replace "${ADS_API_TYPE}" .Values.proxy.adsApiType -}}
{{- if contains "${" $t -}}
{{- fail (printf "the Envoy bootstrap template has a placeholder this chart does not fill:\n%s" $t) -}}
{{- end -}}
{{- $t -}}
{{- end -}}
