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
{{- printf "%s://%s-etcd:2379" (include "connex.etcdScheme" .) $full -}}
{{- else -}}
{{- .Values.etcd.external -}}
{{- end -}}
{{- end -}}

{{- define "connex.etcdScheme" -}}
{{- ternary "https" "http" (and .Values.etcd.enabled .Values.etcd.tls.enabled) -}}
{{- end -}}

{{/* The etcd TLS Secrets: the server's (etcd members, also their peer
certificate) and the routers' client certificate; kubernetes.io/tls layout
(ca.crt, tls.crt, tls.key), made by the chart unless named. */}}
{{- define "connex.etcdServerSecret" -}}
{{- default (printf "%s-etcd-server" (include "connex.fullname" .)) .Values.etcd.tls.serverSecret -}}
{{- end -}}

{{- define "connex.etcdClientSecret" -}}
{{- default (printf "%s-etcd-client" (include "connex.fullname" .)) .Values.etcd.tls.clientSecret -}}
{{- end -}}

{{/* Whether the routers talk to etcd with a client certificate. */}}
{{- define "connex.etcdClientTls" -}}
{{- if and .Values.etcd.tls.enabled (include "connex.etcdEndpoints" .) -}}
{{- if and (not .Values.etcd.enabled) (not .Values.etcd.tls.clientSecret) -}}
{{- fail "etcd.external with etcd.tls.enabled needs etcd.tls.clientSecret (ca.crt, tls.crt, tls.key of the routers' client certificate), or etcd.tls.enabled=false" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* A Kubernetes memory quantity (whole number, optional suffix Ki Mi Gi Ti
k M G T) in bytes: call with (list "what" quantity). */}}
{{- define "connex.bytes" -}}
{{- $what := index . 0 -}}
{{- $q := index . 1 -}}
{{- if or (kindIs "float64" $q) (kindIs "int" $q) (kindIs "int64" $q) -}}
{{- int64 $q -}}
{{- else -}}
{{- $q = toString $q -}}
{{- $n := regexFind "^[0-9]+" $q -}}
{{- $unit := trimPrefix $n $q -}}
{{- $scale := dict "" 1 "k" 1000 "K" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 -}}
{{- if or (not $n) (not (hasKey $scale $unit)) -}}
{{- fail (printf "%s: %q is not a memory quantity the chart reads (a whole number, optionally with Ki, Mi, Gi, Ti, k, M, G or T)" $what $q) -}}
{{- end -}}
{{- mul (int64 $n) (index $scale $unit) -}}
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

{{/* The shared response store's URL: the release's Redis, an external one,
or none. */}}
{{- define "connex.responseStoreUrl" -}}
{{- if .Values.responseStore.redis.enabled -}}
{{- if .Values.responseStore.external -}}
{{- fail "responseStore: set redis.enabled or external, not both" -}}
{{- end -}}
{{- printf "redis://%s-redis:6379" (include "connex.fullname" .) -}}
{{- else -}}
{{- with .Values.responseStore.external -}}
{{- if not (regexMatch "^rediss?://[^@/]+(/[0-9]+)?$" .) -}}
{{- fail "responseStore.external: give redis://HOST:PORT[/DB] or rediss://..., without a password (responseStore.password.existingSecret)" -}}
{{- end -}}
{{- . -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the response store's password, if any. */}}
{{- define "connex.responseStoreSecret" -}}
{{- if .Values.responseStore.password.existingSecret -}}
{{- .Values.responseStore.password.existingSecret -}}
{{- else if .Values.responseStore.redis.enabled -}}
{{- printf "%s-redis" (include "connex.fullname" .) -}}
{{- end -}}
{{- end -}}
