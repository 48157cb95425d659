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
