{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "trainergroup.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: the release name, plus the chart name unless the release name already holds it.
Truncated so that "<fullname>-operator-metrics" still fits in a DNS label.
*/}}
{{- define "trainergroup.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "trainergroup.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "trainergroup.labels" -}}
helm.sh/chart: {{ include "trainergroup.chart" . }}
{{ include "trainergroup.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: trainergroup
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the operator's pod (stable across upgrades: never add to them). */}}
{{- define "trainergroup.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trainergroup.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels for client objects (no component: operator, so they never match the selector). */}}
{{- define "trainergroup.clientLabels" -}}
helm.sh/chart: {{ include "trainergroup.chart" . }}
app.kubernetes.io/name: {{ include "trainergroup.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: client
app.kubernetes.io/part-of: trainergroup
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The operator's ServiceAccount name. */}}
{{- define "trainergroup.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-operator" (include "trainergroup.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image reference. */}}
{{- define "trainergroup.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/*
What the operator may do in a namespace it watches: the rules of its Role (one per watched
namespace) or of its ClusterRole (all namespaces). Exactly tg_operator.rbac.OPERATOR_RULES,
the operator's own list (tests/deploy checks they agree). Least privilege: no Secrets, no
ConfigMaps, no create/delete of TrainerGroups, read-only Pods. Proven on a real API server
(RBAC on) by tests/deploy/test_chart_k8s.py.
*/}}
{{/* The selector labels as k=v,k=v (TG_OPERATOR_POD_LABELS). */}}
{{- define "trainergroup.selectorLabelList" -}}
{{- $out := list }}
{{- range $k, $v := (include "trainergroup.selectorLabels" . | fromYaml) }}
{{- $out = append $out (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $out }}
{{- end }}

{{- define "trainergroup.operatorRules" -}}
# kopf watches TrainerGroups and patches their metadata (finalizer, progress annotations).
- apiGroups: ["trainergroup.io"]
  resources: ["trainergroups"]
  verbs: ["get", "list", "watch", "patch"]
# The operator writes the status subresource.
- apiGroups: ["trainergroup.io"]
  resources: ["trainergroups/status"]
  verbs: ["get", "patch"]
# Owner references with blockOwnerDeletion on the RayCluster need this where the
# OwnerReferencesPermissionEnforcement admission plugin is on.
- apiGroups: ["trainergroup.io"]
  resources: ["trainergroups/finalizers"]
  verbs: ["update"]
# The RayCluster it creates for a TrainerGroup (same name, owned by it); watched.
- apiGroups: ["ray.io"]
  resources: ["rayclusters"]
  verbs: ["get", "list", "watch", "create", "delete"]
# spec.queue: the Kueue Workload of a suspended RayCluster, for its admission message (read).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list"]
# Readiness: each Ray pod's Ready and PodScheduled (Unschedulable) conditions, watched.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# kopf.event(): phase changes and failures.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# The checkpoint claim (rayCluster.storage.claimName), read once before the RayCluster is
# created: an access mode that cannot serve the pods that mount it fails the group. Read
# only: the operator never creates or deletes a claim.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get"]
# Each group's Ray token Secret (<name>-ray-token) and Tinker API keys Secret
# (<name>-tinker-keys, created once with one random key): create only (no get/list/watch).
# The token is derived from the operator's key, so the operator reads no Secret anywhere.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# Each group's NetworkPolicies (<name>-ray with its RayCluster, <name>-tinker).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create"]
# The Tinker API server (<name>-tinker): its Deployment is watched (status.apiURL follows
# its availability), created once and patched when the spec changes its pod; its Service
# and ServiceAccount are created once. The same for the namespace's Tinker gateway
# (tinker-gateway: its Deployment's owners are patched as groups come; its Role reads
# TrainerGroups).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["create"]
# The server's Role (get/watch on its own TrainerGroup, which the operator holds itself)
# and RoleBinding.
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["create"]
{{- end }}

{{/*
Cluster-scoped reads, in the all-namespaces ClusterRole only (a watched-namespaces install
grants none: the operator then leaves their message out). Exactly
tg_operator.rbac.OPERATOR_CLUSTER_RULES (tests/deploy checks they agree).
*/}}
{{- define "trainergroup.operatorClusterRules" -}}
# spec.queue.priorityClass: does Kueue's WorkloadPriorityClass exist? (Kueue makes no Workload
# and posts no event for a RayCluster whose priority class is missing.)
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloadpriorityclasses"]
  verbs: ["get"]
{{- end }}

{{/* Optional (rbac.crdDiscovery): kopf noticing CRD changes while it runs. Read-only. */}}
{{- define "trainergroup.crdDiscoveryRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
{{- end }}
