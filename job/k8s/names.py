"""Labels and annotations that ``charts/biggraph`` and the commands agree on.

The chart writes the names of a job's ConfigMap, Service and NetworkPolicy into annotations of its
Job; ``status`` finds the ConfigMap there, so these strings are a contract with the chart (``cancel`` goes by
the release's ``app.kubernetes.io/instance`` label instead: ``job.k8s.cluster.INSTANCE_LABEL``).
"""

from __future__ import annotations

CONFIG_MAP_ANNOTATION = "biggraph.io/config-map"
SERVICE_ANNOTATION = "biggraph.io/service"
NETWORK_POLICY_ANNOTATION = "biggraph.io/network-policy"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
