{{- /*
What the two node policies share: the agent's (node-policy.yaml) and the registrar's
(registrar-node-policy.yaml). Both narrow a service account's node patches to the startup
taint aether.io/agent-not-ready:NoSchedule and leave everything else of the node as it was,
so the fields compared, and how, are written once, here.
*/ -}}

{{/* The requests both policies see: every write to a node object or its status. */}}
{{- define "aether-agent.nodePolicy.matchConstraints" -}}
resourceRules:
  - apiGroups: [""]
    apiVersions: ["*"]
    operations: ["CREATE", "UPDATE", "DELETE"]
    resources: ["nodes", "nodes/status"]
{{- end -}}

{{- /*
The startup taint's key, and the node's taints less that key with NoSchedule, before and
after. The same key with another effect (NoExecute included) is one of the other taints.
*/ -}}
{{- define "aether-agent.nodePolicy.taintVariables" -}}
- name: taintKey
  expression: "'aether.io/agent-not-ready'"
- name: otherTaints
  expression: >-
    (has(object.spec.taints) ? object.spec.taints : []).filter(t,
    !(t.key == variables.taintKey && has(t.effect) && t.effect == 'NoSchedule'))
- name: oldOtherTaints
  expression: >-
    (has(oldObject.spec.taints) ? oldObject.spec.taints : []).filter(t,
    !(t.key == variables.taintKey && has(t.effect) && t.effect == 'NoSchedule'))
{{- end -}}

{{- /*
Validations both policies make; `who` names the writer in the messages. Only an UPDATE of
the node object itself (a patch arrives as one); the other taints, every other field of the
spec, the labels, annotations, finalizers and owner references unchanged. Status cannot
change through the node object (the API server keeps it), and metadata the server maintains
(resourceVersion, managedFields) is not compared. scripts/check_chart.py checks that the
spec fields are every NodeSpec field but taints of the Kubernetes version it validates
against.
*/ -}}
{{- define "aether-agent.nodePolicy.unchangedValidations" -}}
{{- $specFields := list "podCIDR" "podCIDRs" "providerID" "unschedulable" "configSource" "externalID" -}}
{{- $metaFields := list "labels" "annotations" "finalizers" "ownerReferences" -}}
- expression: "request.operation == 'UPDATE' && (!has(request.subResource) || request.subResource == '')"
  message: "{{ .who }} may only patch a node object: no create, delete or subresource"
- expression: "request.operation != 'UPDATE' || variables.otherTaints == variables.oldOtherTaints"
  message: "{{ .who }} may not change a node's taints other than aether.io/agent-not-ready:NoSchedule"
- expression: >-
    request.operation != 'UPDATE' || (
    {{- range $i, $f := $specFields }}{{ if $i }} &&{{ end }}
    (has(object.spec.{{ $f }}) == has(oldObject.spec.{{ $f }}) && (!has(object.spec.{{ $f }}) || object.spec.{{ $f }} == oldObject.spec.{{ $f }}))
    {{- end }})
  message: "{{ .who }} may not change the node's spec beyond the aether.io/agent-not-ready taint"
- expression: >-
    request.operation != 'UPDATE' || (
    {{- range $i, $f := $metaFields }}{{ if $i }} &&{{ end }}
    (has(object.metadata.{{ $f }}) == has(oldObject.metadata.{{ $f }}) && (!has(object.metadata.{{ $f }}) || object.metadata.{{ $f }} == oldObject.metadata.{{ $f }}))
    {{- end }})
  message: "{{ .who }} may not change the node's labels, annotations, finalizers or owner references"
{{- end -}}

{{/* The binding: the named policy, cluster-wide, denying. */}}
{{- define "aether-agent.nodePolicy.binding" -}}
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingAdmissionPolicyBinding
metadata:
  name: {{ .name }}
  labels:
    {{- include "aether-agent.labels" .ctx | nindent 4 }}
    {{- with .component }}
    app.kubernetes.io/component: {{ . }}
    {{- end }}
spec:
  policyName: {{ .name }}
  validationActions: [Deny]
{{- end -}}
