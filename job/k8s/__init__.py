"""Training on Kubernetes, as a library: what ``biggraph submit/status/logs/cancel/preflight`` do.

``submit`` renders ``charts/biggraph`` with the real ``helm`` binary (on PATH, or given: the chart is the
one source of the manifests), the training config as its ``config`` value, and creates the objects through
the ``kubernetes`` dynamic client. The chart writes the name of its ConfigMap into an annotation of the Job,
which is how ``status`` finds the config (to read progress from ``checkpoint_path``, with the config's own
``storage_options``); ``cancel`` deletes the objects labelled with the release. Every failure a user can
fix (no helm, no cluster, 403, an unknown job) is a one-line ``UserError``.

The rendering follows the cluster's Kubernetes minor (given, else the server's ``/version``) through
``helm template --kube-version`` (the chart's ``.Capabilities`` checks).

Modules: ``names`` (labels and annotations the chart and the commands share), ``cluster`` (API
access), ``render`` (helm rendering, Kubernetes versions), ``jobs`` (submit, status, logs,
cancel), ``progress`` (training progress from a checkpoint), ``preflight`` (a pod's storage checks).
The command line is in :mod:`job.cli.k8s`.
"""
