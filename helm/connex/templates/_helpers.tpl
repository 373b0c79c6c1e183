{{/* Names, labels and the URLs the parts of the release use to find each other. */}}

{{- define "connex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "connex.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "connex.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "connex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: call with (list $ "router"). */}}
{{- define "connex.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "connex.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "connex.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- $full := include "connex.fullname" . -}}
{{- printf "http://%s-etcd:2379" $full -}}
{{- else -}}
{{- .Values.etcd.external -}}
{{- end -}}
{{- end -}}

{{/* Where engines register: the internal Service, which includes not-ready router pods. */}}
{{- define "connex.registerUrl" -}}
{{- printf "http://%s-router-internal:%d" (include "connex.fullname" .) (int .Values.router.internalPort) -}}
{{- end -}}

{{- define "connex.adminSecret" -}}
{{- default (printf "%s-admin" (include "connex.fullname" .)) .Values.router.adminToken.existingSecret -}}
{{- end -}}

{{- define "connex.registerSecret" -}}
{{- default (printf "%s-register" (include "connex.fullname" .)) .Values.router.registerToken.existingSecret -}}
{{- end -}}

{{- define "connex.transferSecret" -}}
{{- default (printf "%s-transfer" (include "connex.fullname" .)) .Values.router.transferSecret.existingSecret -}}
{{- end -}}

{{/* The CONNEX_TRANSFER_SECRET env entry, for the engines. */}}
{{- define "connex.transferSecretEnv" -}}
- name: CONNEX_TRANSFER_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "connex.transferSecret" . }}
      key: {{ .Values.router.transferSecret.secretKey }}
{{- end -}}

{{/* The CONNEX_REGISTER_TOKEN env entry, for the engines' agents. */}}
{{- define "connex.registerTokenEnv" -}}
- name: CONNEX_REGISTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "connex.registerSecret" . }}
      key: {{ .Values.router.registerToken.secretKey }}
{{- end -}}

{{/* Pod affinity of a component: the values' own `affinity` when set, else a
spread of its pods over nodes: call with (list $ "router" "soft"|"hard"|"none" affinity). */}}
{{- define "connex.affinity" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $mode := index . 2 -}}
{{- $own := index . 3 -}}
{{- if $own }}
affinity:
  {{- toYaml $own | nindent 2 }}
{{- else if eq $mode "hard" }}
affinity:
  podAntiAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "connex.selector" (list $root $component) | nindent 12 }}
{{- else if eq $mode "soft" }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "connex.selector" (list $root $component) | nindent 14 }}
{{- else if ne $mode "none" }}
{{- fail (printf "podAntiAffinity must be soft, hard or none, not %q" $mode) }}
{{- end }}
{{- end -}}
