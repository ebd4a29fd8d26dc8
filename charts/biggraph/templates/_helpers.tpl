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
{{- if has .Values.stage (list "train" "import") -}}
{{- sub (int .Values.replicas) (int (include "biggraph.minReplicas" .)) -}}
{{- else -}}0{{- end -}}
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

{{/*
The import stage's command: the entrypoint execs a first argument that is not an option as is. Every pod runs the
same command; Kubernetes gives each its JOB_COMPLETION_INDEX, which `biggraph import --pods N` takes as its index.
*/}}
{{- define "biggraph.importArgs" -}}
{{- if not .Values.importer.files -}}
{{- fail "stage: import needs importer.files (the raw edge lists, one per edge_paths entry)" -}}
{{- end -}}
- biggraph
- import
- /etc/biggraph/config.yaml
{{- range .Values.importer.files }}
- {{ . | quote }}
{{- end }}
{{- range .Values.importer.args }}
- {{ . | quote }}
{{- end }}
- --pods
- {{ int .Values.replicas | quote }}
{{- end -}}

{{/* Pods of the stage's Job: replicas for train and import, one for eval, export and archive. */}}
{{- define "biggraph.pods" -}}
{{- if has .Values.stage (list "train" "import") -}}{{ int .Values.replicas }}{{- else -}}1{{- end -}}
{{- end -}}

{{/* The one-pod stages' commands (eval, export, archive), each writing its output to the URL of its values. */}}
{{- define "biggraph.stageArgs" -}}
{{- $stage := .Values.stage -}}
{{- $values := index .Values $stage -}}
{{- if not $values.out -}}
{{- fail (printf "stage: %s needs %s.out (the URL its output goes to)" $stage $stage) -}}
{{- end -}}
- biggraph
- {{ $stage }}
- /etc/biggraph/config.yaml
{{- if eq $stage "eval" }}
{{- with $values.candidates }}
- --candidates
- {{ . | quote }}
{{- end }}
{{- range $values.filter }}
- --filter
- {{ . | quote }}
{{- end }}
- --json
{{- end }}
- --out
- {{ $values.out | quote }}
{{- if eq $stage "export" }}
- --format
- {{ $values.format | quote }}
- --overwrite
{{- end }}
{{- if eq $stage "archive" }}
- --dtype
- {{ $values.dtype | quote }}
{{- with $values.tag }}
- --tag
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
A size in bytes (an int64): a Kubernetes quantity ("4Gi", "500M", 1073741824) or a memory_budget ("8GiB",
"500MB", "1e9"); units are read case-insensitively, as the trainer reads memory_budget.
*/}}
{{- define "biggraph.bytes" -}}
{{- $text := toString . | trim -}}
{{- $pattern := "^([0-9.]+(?:[eE][-+]?[0-9]+)?)\\s*([A-Za-z]*)$" -}}
{{- if not (regexMatch $pattern $text) -}}
{{- fail (printf "%q is not a size (e.g. 8Gi, 8GiB, 500MB or a number of bytes)" $text) -}}
{{- end -}}
{{- $units := dict "" 1 "b" 1 "k" 1e3 "kb" 1e3 "m" 1e6 "mb" 1e6 "g" 1e9 "gb" 1e9 "t" 1e12 "tb" 1e12 "ki" 1024 "kib" 1024 "mi" 1048576 "mib" 1048576 "gi" 1073741824 "gib" 1073741824 "ti" 1099511627776 "tib" 1099511627776 -}}
{{- $unit := regexReplaceAll $pattern $text "${2}" | lower -}}
{{- if not (hasKey $units $unit) -}}
{{- fail (printf "%q is not a size: unknown unit %q" $text $unit) -}}
{{- end -}}
{{- ceil (mulf (float64 (regexReplaceAll $pattern $text "${1}")) (get $units $unit)) | int64 -}}
{{- end -}}

{{/* Bytes as the smallest whole Mi quantity holding them (whole Gi as "6Gi"), as job/k8s/sizing.py writes them. */}}
{{- define "biggraph.quantity" -}}
{{- $mib := div (add (int64 .) 1048575) 1048576 | int64 -}}
{{- if eq (mod $mib 1024) 0 -}}{{ printf "%dGi" (div $mib 1024) }}{{- else -}}{{ printf "%dMi" $mib }}{{- end -}}
{{- end -}}

{{/* The config's memory_budget in bytes, 0 when it has none. */}}
{{- define "biggraph.memoryBudget" -}}
{{- $budget := (default dict .Values.config).memory_budget -}}
{{- if kindIs "invalid" $budget -}}0{{- else -}}{{ include "biggraph.bytes" $budget }}{{- end -}}
{{- end -}}

{{/*
The memory a trainer's tables may take, in bytes: the config's memory_budget (the trainer keeps its partitions,
their Adagrad sums and the unpartitioned tables within it), else the container's memory limit (shared memory
counts against it); 0 when neither is set. Refuses a memory_budget above the memory limit.
*/}}
{{- define "biggraph.tableBytes" -}}
{{- $budget := int64 (include "biggraph.memoryBudget" .) -}}
{{- $limit := dig "limits" "memory" "" (default dict .Values.resources) -}}
{{- $limitBytes := 0 | int64 -}}
{{- if $limit -}}{{- $limitBytes = int64 (include "biggraph.bytes" $limit) -}}{{- end -}}
{{- if and (gt $budget 0) (gt $limitBytes 0) (gt $budget $limitBytes) -}}
{{- fail (printf "resources.limits.memory %s is below the config's memory_budget %s: raise resources.limits.memory to at least %s or lower config.memory_budget" (toString $limit) (toString .Values.config.memory_budget) (include "biggraph.quantity" $budget)) -}}
{{- end -}}
{{- if gt $budget 0 -}}{{ $budget }}{{- else -}}{{ $limitBytes }}{{- end -}}
{{- end -}}

{{/*
/dev/shm's sizeLimit: shm.sizeLimit, else what the trainer's tables may take (every partition and its Adagrad
sums live in shared memory on a CPU trainer, with or without Hogwild workers); "" (no limit) when unknown.
*/}}
{{- define "biggraph.shmSizeLimit" -}}
{{- if .Values.shm.sizeLimit -}}
{{- .Values.shm.sizeLimit -}}
{{- else -}}
{{- $tables := int64 (include "biggraph.tableBytes" .) -}}
{{- if gt $tables 0 -}}{{ include "biggraph.quantity" $tables }}{{- end -}}
{{- end -}}
{{- end -}}

{{/*
/tmp's sizeLimit: tmp.sizeLimit, else 2Gi plus what the trainer's tables may take (with checkpoint_path on an
object store, partition files are read and uploaded through whole local copies in /tmp).
*/}}
{{- define "biggraph.tmpSizeLimit" -}}
{{- if .Values.tmp.sizeLimit -}}
{{- .Values.tmp.sizeLimit -}}
{{- else -}}
{{- include "biggraph.quantity" (add 2147483648 (int64 (include "biggraph.tableBytes" .))) -}}
{{- end -}}
{{- end -}}

{{/* The edge cache's bound in bytes: half its volume (the file in use and the one downloading come on top). */}}
{{- define "biggraph.edgeCacheBytes" -}}
{{- div (int64 (include "biggraph.bytes" .Values.edgeCache.sizeLimit)) 2 -}}
{{- end -}}

{{/* The group's secret (templates/secret.yaml, or groupSecret.existingSecret). */}}
{{- define "biggraph.groupSecretName" -}}
{{- .Values.groupSecret.existingSecret | default (printf "%s-group" (include "biggraph.fullname" .)) -}}
{{- end -}}
