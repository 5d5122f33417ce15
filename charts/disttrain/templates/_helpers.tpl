{{/* "<release>-operator", unless fullnameOverride: the name of every object the chart creates. */}}
{{- define "disttrain.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The pod selector: stable across upgrades (a Deployment's selector is immutable). */}}
{{- define "disttrain.selectorLabels" -}}
app.kubernetes.io/name: disttrain-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "disttrain.labels" -}}
{{ include "disttrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The Lease on which the operator's replicas elect the acting one, in the release namespace. */}}
{{- define "disttrain.leaderLease" -}}
{{- printf "%s-leader" (include "disttrain.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "disttrain.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/*
RBAC, exactly what the operator uses (docs/operator.md, "RBAC"). Cluster-scoped reads, always in the ClusterRole:
  - customresourcedefinitions list/watch: kopf discovers and follows the resources it serves through them;
  - nodes list/watch: kopf watches nodes (the adapter judges pods by their node) and the adapter lists them once.
*/}}
{{- define "disttrain.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
{{- end -}}

{{/*
Namespaced, in the ClusterRole when serving all namespaces, else in a Role per watched namespace:
  - disttrainjobs: kopf lists/watches them and patches its finalizer; the adapter lists them once, deletes
    finished ones (TTL) and patches their status; get/watch/patch on both also cover the per-job agent Role that
    the operator creates (RBAC refuses to create a Role granting more than its creator holds);
  - pods list/watch/create/delete: kopf watches the job's pods, the adapter creates and deletes them;
  - services, serviceaccounts, secrets, networkpolicies, roles, rolebindings create: the per-job Services, store
    Secret, NetworkPolicies and the agent's RBAC;
  - get on pods and those kinds but secrets: after a 409 on create, whose is the existing object (its owner uid:
    ours, or an older job's of the same name that the garbage collector is still deleting, which is never
    adopted); the store Secret's name holds the job's UID instead, so the operator never reads a Secret;
  - events create: the adapter's Events and kopf's own (core/v1);
  - podgroups create/patch (Volcano's and scheduler-plugins'): the PodGroup of a job with spec.gang, created and
    kept in step with one server-side apply (a PATCH, which the API server authorizes as create when the object
    does not exist yet).
*/}}
{{- define "disttrain.namespacedRules" -}}
- apiGroups: ["disttrain.dev"]
  resources: ["disttrainjobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["disttrain.dev"]
  resources: ["disttrainjobs/status"]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create"]
# The job agents' Leases (their own heartbeat): created with each agent, watched; patch is what the agent's Role
# grants (RBAC lets the operator grant only what it holds).
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["scheduling.volcano.sh", "scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["create", "patch"]
{{- end -}}
