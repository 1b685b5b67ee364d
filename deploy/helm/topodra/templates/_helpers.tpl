{{/* Labels every object carries; selectors use only name + component (stable across upgrades). */}}
{{- define "topodra.labels" -}}
app.kubernetes.io/name: topodra
app.kubernetes.io/part-of: topodra
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "topodra.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* KUBERNETES_SERVICE_HOST/PORT overrides (apiServer.host/port), for clusters whose pods cannot reach the Service. */}}
{{- define "topodra.apiServerEnv" -}}
{{- if .Values.apiServer.host }}
- {name: KUBERNETES_SERVICE_HOST, value: {{ .Values.apiServer.host | quote }}}
- {name: KUBERNETES_SERVICE_PORT, value: {{ .Values.apiServer.port | toString | quote }}}
{{- end }}
{{- end }}
