{{/* Chart name, at most 63 characters (a label value). */}}
{{- define "biggraph.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The Job's name: fullnameOverride, else the release name (plus the chart name unless already in it).
At most 56 characters so that pod hostnames "<job>-<index>" stay within the 63 of a DNS label.
*/}}
{{- define "biggraph.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 56 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 56 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 56 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Headless Service giving pods the DNS names "<job>-<index>.<service>". */}}
{{- define "biggraph.serviceName" -}}
{{- include "biggraph.fullname" . | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "biggraph.configMapName" -}}
{{- printf "%s-config" (include "biggraph.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "biggraph.pvcName" -}}
{{- if .Values.persistence.existingClaim -}}
{{- .Values.persistence.existingClaim -}}
{{- else -}}
{{- printf "%s-data" (include "biggraph.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "biggraph.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "biggraph.fullname" .) .Values.serviceAccount.name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "biggraph.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "biggraph.selectorLabels" -}}
app.kubernetes.io/name: {{ include "biggraph.name" . }}
app.kubernetes.io/instance: {{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "biggraph.labels" -}}
helm.sh/chart: {{ include "biggraph.chart" . }}
{{ include "biggraph.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "biggraph.image" -}}
{{- $variant := ternary "cu124" "cpu" (gt (int .Values.gpu.count) 0) -}}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion $variant) .Values.image.tag -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* The smallest number of pods training goes on with: elastic.minReplicas, 0 meaning "replicas" (fixed size). */}}
{{- define "biggraph.minReplicas" -}}
{{- $max := int .Values.replicas -}}
{{- $min := int .Values.elastic.minReplicas -}}
{{- if eq $min 0 -}}{{- $min = $max -}}{{- end -}}
{{- if gt $min $max -}}
{{- fail (printf "elastic.minReplicas (%d) must not exceed replicas (%d)" $min $max) -}}
{{- end -}}
{{- $min -}}
{{- end -}}

{{/* torchrun's --nnodes: MIN:MAX. */}}
{{- define "biggraph.nnodes" -}}
{{- printf "%s:%d" (include "biggraph.minReplicas" .) (int .Values.replicas) -}}
{{- end -}}

{{/* Indexes that may run out of retries while training goes on: the pods an elastic job can lose. */}}
{{- define "biggraph.maxFailedIndexes" -}}
{{- sub (int .Values.replicas) (int (include "biggraph.minReplicas" .)) -}}
{{- end -}}

{{- define "biggraph.networkPolicyName" -}}
{{- include "biggraph.fullname" . -}}
{{- end -}}

{{- define "biggraph.rdzvEndpoint" -}}
{{- if .Values.torchrun.rdzvEndpoint -}}
{{- .Values.torchrun.rdzvEndpoint -}}
{{- else if eq .Values.torchrun.rdzvBackend "c10d" -}}
{{- printf "%s-0.%s:%d" (include "biggraph.fullname" .) (include "biggraph.serviceName" .) (int .Values.torchrun.rdzvPort) -}}
{{- else -}}
{{- fail "torchrun.rdzvEndpoint is required when torchrun.rdzvBackend is not c10d (e.g. etcd-host:2379 for etcd-v2)" -}}
{{- end -}}
{{- end -}}

{{/* The container's args: torchrun options, then `-m job train CONFIG`. */}}
{{- define "biggraph.torchrunArgs" -}}
- --nnodes={{ include "biggraph.nnodes" . }}
- --nproc-per-node={{ int .Values.torchrun.nprocPerNode }}
- --rdzv-backend={{ .Values.torchrun.rdzvBackend }}
- --rdzv-endpoint={{ include "biggraph.rdzvEndpoint" . }}
- --rdzv-id={{ include "biggraph.fullname" . }}
{{- with .Values.torchrun.rdzvConf }}
- --rdzv-conf={{ range $i, $k := keys . | sortAlpha }}{{ if $i }},{{ end }}{{ $k }}={{ index $.Values.torchrun.rdzvConf $k }}{{ end }}
{{- end }}
- --max-restarts={{ int .Values.torchrun.maxRestarts }}
- -m
- job
- train
- /etc/biggraph/config.yaml
{{- range .Values.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}
