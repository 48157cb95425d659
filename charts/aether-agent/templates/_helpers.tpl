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

{{/* The registrar's Lease (leader election): one per release, in the release namespace. */}}
{{- define "aether-agent.registrarLeaseName" -}}
{{- include "aether-agent.registrarName" . -}}
{{- end -}}

{{/*
The agent DaemonSet's selector labels as a label selector (name=...,instance=...,component=agent),
made from the same helper so the two cannot drift: the registrar's taint guard counts these
pods only, never another release's agents.
*/}}
{{- define "aether-agent.agentSelector" -}}
{{- include "aether-agent.selectorLabels" (dict "ctx" . "component" "agent") | replace ": " "=" | replace "\n" "," -}}
{{- end -}}

{{/* The agent's registrar: agent.registrar, else the chart's registrar Service when enabled. */}}
{{- define "aether-agent.registrarAddress" -}}
{{- if .Values.agent.registrar -}}
{{- .Values.agent.registrar -}}
{{- else if .Values.registrar.enabled -}}
{{- printf "%s.%s.svc:%d" (include "aether-agent.registrarName" .) .Release.Namespace (int .Values.registrar.port) -}}
{{- end -}}
{{- end -}}

{{/*
The Secret of the registrar's serving pair and CA: registrar.tls.secretName, else, with the
chart's registrar and a cert-manager issuer, the Secret its Certificate writes
(registrar-certificate.yaml); "" when the registrar has no TLS source.
*/}}
{{- define "aether-agent.registrarTLSSecret" -}}
{{- if .Values.registrar.tls.secretName -}}
{{- .Values.registrar.tls.secretName -}}
{{- else if and .Values.registrar.enabled (include "aether-agent.registrarIssuer" .) -}}
{{- printf "%s-tls" (include "aether-agent.registrarName" .) -}}
{{- end -}}
{{- end -}}

{{/* registrar.tls.certManager.issuerRef.name, "" when unset (or its parents are null). */}}
{{- define "aether-agent.registrarIssuer" -}}
{{- dig "certManager" "issuerRef" "name" "" (.Values.registrar.tls | default dict) -}}
{{- end -}}

{{- define "aether-agent.uninstallName" -}}
{{- printf "%s-cni-uninstall" (include "aether-agent.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The worker's gid, from agent.workerUser (uid:gid). */}}
{{- define "aether-agent.workerGid" -}}
{{- $parts := splitList ":" .Values.agent.workerUser -}}
{{- if ne (len $parts) 2 -}}
{{- fail (printf "agent.workerUser is %q; it must be uid:gid" .Values.agent.workerUser) -}}
{{- end -}}
{{- index $parts 1 -}}
{{- end -}}

{{/* The agent's service-account user name, as the API server authenticates its token. */}}
{{- define "aether-agent.serviceAccountUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "aether-agent.serviceAccountName" .) -}}
{{- end -}}

{{/* The registrar's service-account user name, as the API server authenticates its token. */}}
{{- define "aether-agent.registrarServiceAccountUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "aether-agent.registrarName" .) -}}
{{- end -}}

{{/*
The agent DaemonSet's nodeSelector as a label selector (k=v,..., keys sorted so the
rendering is stable; "" when it has none): the registrar's taint guard covers these nodes
only, the ones the agent runs on.
*/}}
{{- define "aether-agent.agentNodeSelector" -}}
{{- $sel := .Values.agent.nodeSelector | default dict -}}
{{- $terms := list -}}
{{- range $k := keys $sel | sortAlpha -}}
{{- $terms = append $terms (printf "%s=%v" $k (index $sel $k)) -}}
{{- end -}}
{{- join "," $terms -}}
{{- end -}}

{{/* Envoy's admin socket, in the proxy pod's own emptyDir. */}}
{{- define "aether-agent.envoyAdminDir" -}}/var/run/envoy-admin{{- end -}}

{{/*
The xDS relay's folder (proxy.relay): an emptyDir of the proxy pod, shared by the relay and
Envoy, holding the relay's listening socket xds.sock (0660, the relay's uid and group).
*/}}
{{- define "aether-agent.relayDir" -}}/var/run/aether-relay{{- end -}}

{{/*
The folder of the xds.sock Envoy dials: the relay's (proxy.relay.enabled), else the
agent's run folder. The relay serves both ADS variants (proxy.adsApiType).
*/}}
{{- define "aether-agent.envoyXdsDir" -}}
{{- if .Values.proxy.relay.enabled -}}
{{- include "aether-agent.relayDir" . -}}
{{- else -}}
{{- include "aether-agent.runDir" . -}}
{{- end -}}
{{- end -}}

{{/*
The relay's --metrics-addr: "off" unless proxy.relay.metrics.enabled; else HOST:PORT, the
node's IP ($(HOST_IP), from the downward API) unless metrics.host names one. The pod is
hostNetwork: a port the agent's metrics, Envoy's stats or its readiness listener use on the
node fails the render.
*/}}
{{- define "aether-agent.relayMetricsAddr" -}}
{{- $m := .Values.proxy.relay.metrics -}}
{{- if not $m.enabled -}}off{{- else -}}
{{- $port := int $m.port -}}
{{- range $name, $taken := dict "agent.metrics.port" (int .Values.agent.metrics.port) "proxy.stats.port" (ternary (int .Values.proxy.stats.port) 0 .Values.proxy.stats.enabled) "proxy.readinessPort" (int .Values.proxy.readinessPort) -}}
{{- if eq $port $taken -}}
{{- fail (printf "proxy.relay.metrics.port %d is %s too: the proxy pod is hostNetwork, the two would collide on the node" $port $name) -}}
{{- end -}}
{{- end -}}
{{- $host := $m.host | default "$(HOST_IP)" -}}
{{- if and (contains ":" $host) (not (hasPrefix "[" $host)) -}}{{- $host = printf "[%s]" $host -}}{{- end -}}
{{- printf "%s:%d" $host $port -}}
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

The admin interface is a pipe in the proxy pod's own folder, mode 0600 (384): only Envoy's
uid connects, and nothing on the node's network reaches it. The kubelet's readiness probe
cannot speak to a unix socket, so the chart adds to the filled template one static listener
on the node's loopback (proxy.readinessPort) that forwards GET /ready, and nothing else,
to the admin pipe through the static cluster envoy_admin; every other request gets 404.
With proxy.stats.enabled a second one forwards GET /stats/prometheus the same way, for
Prometheus (files/envoy-stats-listener.yaml).
*/}}
{{- define "aether-agent.envoyBootstrap" -}}
{{- $t := .Files.Get "files/envoy-bootstrap.yaml.tmpl" -}}
{{- if not $t -}}
{{- fail "files/envoy-bootstrap.yaml.tmpl is missing or empty (a link to deploy/envoy/bootstrap.yaml.tmpl)" -}}
{{- end -}}
{{- $adminSock := printf "%s/admin.sock" (include "aether-agent.envoyAdminDir" .) -}}
{{- $admin := printf "{ pipe: { path: %s, mode: 384 } }" $adminSock -}}
{{- $t = regexReplaceAll "(?m)^[ \t]*#.*\n" $t "" -}}
{{- $t = $t | replace "${AETHER_RUN_DIR}" (include "aether-agent.envoyXdsDir" .) -}}
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
{{- $boot := fromYaml $t -}}
{{- if hasKey $boot "Error" -}}
{{- fail (printf "the filled Envoy bootstrap template is not YAML: %s" $boot.Error) -}}
{{- end -}}
{{- if .Values.proxy.meshStats -}}
{{- $_ := unset $boot "stats_config" -}}
{{- end -}}
{{- $static := $boot.static_resources -}}
{{- if or (not $static) (hasKey $static "listeners") -}}
{{- fail "the Envoy bootstrap template must have static_resources and no static listeners: the chart adds the readiness listener" -}}
{{- end -}}
{{- $ready := fromYaml (include "aether-agent.envoyReadyListener" .) -}}
{{- $adminCluster := fromYaml (printf "name: envoy_admin\ntype: STATIC\nconnect_timeout: 1s\nload_assignment:\n  cluster_name: envoy_admin\n  endpoints:\n  - lb_endpoints:\n    - endpoint: { address: { pipe: { path: %s } } }\n" $adminSock) -}}
{{- $listeners := list $ready -}}
{{- if .Values.proxy.stats.enabled -}}
{{- $listeners = append $listeners (fromYaml (include "aether-agent.envoyStatsListener" .)) -}}
{{- end -}}
{{- $_ := set $static "listeners" $listeners -}}
{{- $_ = set $static "clusters" (append $static.clusters $adminCluster) -}}
{{- toYaml $boot -}}
{{- end -}}

{{/*
The stats listener (proxy.stats): GET /stats/prometheus on proxy.stats.host, from the admin
pipe, and 404 to the rest. One ConfigMap serves every node, so the address cannot be each
node's own IP: 0.0.0.0 by default, or an address every node has.
*/}}
{{- define "aether-agent.envoyStatsListener" -}}
{{- $t := .Files.Get "files/envoy-stats-listener.yaml" -}}
{{- if not $t -}}
{{- fail "files/envoy-stats-listener.yaml is missing or empty in the chart" -}}
{{- end -}}
{{- $host := .Values.proxy.stats.host | trimPrefix "[" | trimSuffix "]" -}}
{{- $t = $t | replace "${STATS_ADDRESS}" $host | replace "${STATS_PORT}" (toString (int .Values.proxy.stats.port)) -}}
{{- if contains "${" $t -}}
{{- fail (printf "files/envoy-stats-listener.yaml has a placeholder this chart does not fill:\n%s" $t) -}}
{{- end -}}
{{- $t -}}
{{- end -}}

{{/* The readiness listener: GET /ready on the node's loopback, from the admin pipe. */}}
{{- define "aether-agent.envoyReadyListener" -}}
name: proxy_ready
address: { socket_address: { address: 127.0.0.1, port_value: {{ int .Values.proxy.readinessPort }} } }
filter_chains:
- filters:
  - name: envoy.filters.network.http_connection_manager
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
      stat_prefix: proxy_ready
      route_config:
        name: proxy_ready
        virtual_hosts:
        - name: proxy_ready
          domains: ["*"]
          routes:
          - match:
              path: /ready
              headers:
              - name: ":method"
                string_match: { exact: GET }
            route: { cluster: envoy_admin, timeout: 1s }
          - match: { prefix: / }
            direct_response: { status: 404 }
      http_filters:
      - name: envoy.filters.http.router
        typed_config: { "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router }
{{- end -}}

{{/*
The identity mode: "off", permissive or strict. A bare YAML `off` arrives as false.
*/}}
{{- define "aether-agent.mtls" -}}
{{- $m := .Values.identity.mtls -}}
{{- if or (eq (toString $m) "false") (eq (toString $m) "off") -}}off{{- else -}}{{ $m }}{{- end -}}
{{- end -}}

{{/* "true" when the registrar's TLS is SPIFFE (registrar.tls.spiffe.enabled), else "". */}}
{{- define "aether-agent.registrarSpiffe" -}}
{{- if dig "spiffe" "enabled" false (.Values.registrar.tls | default dict) -}}true{{- end -}}
{{- end -}}

{{/* The registrar's SPIFFE ID: registrar.tls.spiffe.id, else the one of its service account. */}}
{{- define "aether-agent.registrarSpiffeId" -}}
{{- $id := dig "spiffe" "id" "" (.Values.registrar.tls | default dict) -}}
{{- if $id -}}{{- $id -}}{{- else -}}
{{- printf "spiffe://%s/ns/%s/sa/%s" .Values.identity.trustDomain .Release.Namespace (include "aether-agent.registrarName" .) -}}
{{- end -}}
{{- end -}}
