"""Training on Kubernetes, as a library: what ``biggraph submit/status/logs/cancel/preflight`` do.

``submit`` renders ``charts/biggraph`` with the real ``helm`` binary when one is on PATH (or given),
else the plain manifests of ``k8s/base`` with Python, puts the training config in the ConfigMap, and
creates the objects through the ``kubernetes`` client. The chart writes the names of its ConfigMap
and Service into annotations of the Job, which is how ``status`` finds the config (to read progress
from ``checkpoint_path``, with the config's own ``storage_options``) and ``cancel`` what to delete.
Every failure a user can fix (no cluster, 403, an unknown job) is a one-line ``UserError``.

Both renderings follow the cluster's Kubernetes minor (given, else the server's ``/version``): the
chart through ``helm template --kube-version`` (its ``.Capabilities`` checks), the plain manifests by
adding in Python what the chart adds on newer minors (``k8s/base`` is the chart rendered for the
oldest supported one, 1.31).

Modules: ``names`` (labels and annotations the chart and the commands share), ``cluster`` (API
access), ``render`` (helm / plain rendering, Kubernetes versions), ``jobs`` (submit, status, logs,
cancel), ``progress`` (training progress from a checkpoint), ``preflight`` (a pod's storage checks).
The command line is in :mod:`job.cli.k8s`.
"""
