#!/usr/bin/env bash
# Builds the Dockerfile with buildah and runs the image the way a Kubernetes node runs the Job's pods:
# the image's own ENTRYPOINT, ENV and WORKDIR, as uid/gid 10001, root filesystem read-only, a
# writable /tmp and /dev/shm, host network (so two "pods" meet on 127.0.0.1). tests/test_image.py
# drives it; it is also handy by hand. Needs root, buildah and debootstrap (`deps` installs both).
#
#   tests/image.sh deps                  apt-get install buildah + debootstrap when missing
#   tests/image.sh base                  localhost/biggraph-test-base:v1 (debootstrap, cached under .cache/)
#   tests/image.sh build [TAG]           builds Dockerfile, torch from the local CPU wheel; prints
#                                        build_seconds=, size_bytes=, image=
#   tests/image.sh mount IMAGE           a working container of IMAGE; prints its root directory
#   tests/image.sh run IMAGE ROOT [-e K=V]... [-v HOST:CTR[:ro]]... [--tmp DIR] [--name N] [--] [ARGS...]
#                                        runs IMAGE's entrypoint with ARGS (its CMD when none) in ROOT;
#                                        /tmp is a fresh tmpfs, or DIR (an emptyDir you can look into)
#   tests/image.sh clean [--all]         removes every container and image but the base (--all: the store)
#
# Environment: IMAGE_TEST_STORE  buildah storage root (default .cache/image-test/storage): a private
#              store, so that the test never touches /var/lib/containers and is removed in one go;
#              DEBIAN_MIRROR (default: the host's first apt source); PYTHON (default .venv/bin/python).
# Exit code 77 means "cannot run here" (not root, no apt, no wheel): the test skips with the message.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=$REPO/.cache/image-test
STORE=${IMAGE_TEST_STORE:-$CACHE/storage}
# bump when the base recipe changes, so that neither a cached rootfs nor a stored base image is reused
BASE_VERSION=v1
BASE_IMAGE=localhost/biggraph-test-base:$BASE_VERSION
BASE_TAR=$CACHE/base-bookworm-$BASE_VERSION.tar
TORCH_VERSION=2.13.0
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3

cannot() { echo "image test cannot run here: $*" >&2; exit 77; }
bah() { buildah --root "$STORE/root" --runroot "$STORE/run" --storage-driver vfs "$@"; }

deps() {
    mkdir -p "$CACHE"
    [ "$(id -u)" = 0 ] || cannot "needs root (buildah with chroot isolation, mount namespaces)"
    command -v buildah >/dev/null && command -v debootstrap >/dev/null && command -v unshare >/dev/null && command -v jq >/dev/null && return 0
    command -v apt-get >/dev/null || cannot "buildah/debootstrap missing and no apt-get to install them"
    # another apt run (a colleague's, CI's chromium step) may hold the lock for a while: wait for it
    { apt-get -o DPkg::Lock::Timeout=300 update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends \
            buildah debootstrap util-linux jq; } >"$CACHE/apt.log" 2>&1 \
        || cannot "apt-get install buildah debootstrap failed (see $CACHE/apt.log)"
}

debian_mirror() {
    if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
    # the mirror apt already uses (a CI machine may only reach its own), else Debian's CDN
    local uri
    uri=$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\/debian\)[[:space:]]*$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
    [ -n "$uri" ] || uri=$(awk '$1 == "deb" && $2 ~ /\/debian\/?$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
    echo "${uri:-http://deb.debian.org/debian}"
}

base() {
    mkdir -p "$CACHE"
    if [ ! -s "$BASE_TAR" ]; then
        # Stands in for python:3.11-slim, which cannot be pulled here: Debian bookworm's own Python 3.11
        # (the torch wheel is cp311) with venv, and `python` on PATH as in the official image.
        local rootfs=$CACHE/base-rootfs.$$
        rm -rf "$rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3 \
            bookworm "$rootfs" "$(debian_mirror)" >"$CACHE/debootstrap.log" 2>&1 \
            || { rm -rf "$rootfs"; cannot "debootstrap failed (see $CACHE/debootstrap.log)"; }
        # what python:*-slim also leaves out: package lists and caches, docs, man pages, translations
        rm -rf "$rootfs"/var/cache/apt/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* \
            "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*.log "$rootfs"/etc/resolv.conf
        # The host's CA bundle: where egress goes through a TLS-inspecting proxy (as on our CI machines)
        # pip inside the build and the demo's dataset download must trust that proxy's CA, as they
        # would with a corporate base image.
        [ ! -s /etc/ssl/certs/ca-certificates.crt ] || cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/"
        tar -C "$rootfs" --numeric-owner -cf "$BASE_TAR.tmp" . && mv "$BASE_TAR.tmp" "$BASE_TAR"
        rm -rf "$rootfs"
    fi
    bah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1 && return 0
    local ctr mnt
    ctr=$(bah from scratch)
    mnt=$(bah mount "$ctr")
    tar -C "$mnt" --numeric-owner -xf "$BASE_TAR"
    bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
        --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt --cmd python3 "$ctr"
    bah commit -q "$ctr" "$BASE_IMAGE" >/dev/null
    bah rm "$ctr" >/dev/null
}

build() {
    local tag=${1:-localhost/biggraph:test-cpu} wheels=$CACHE/wheels
    mkdir -p "$wheels"
    # The CPU torch wheel wherever pip finds it (find-links, a local index or PyPI's mirror); only the
    # +cpu build: PyPI's plain torch wheel would pull ~3 GB of CUDA libraries into the CPU image.
    ls "$wheels"/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null 2>&1 \
        || "$PYTHON" -m pip download --no-deps -q "torch==$TORCH_VERSION+cpu" -d "$wheels" >"$CACHE/wheel.log" 2>&1 \
        || cannot "no torch==$TORCH_VERSION+cpu wheel reachable through pip (see $CACHE/wheel.log)"
    local started=$SECONDS
    # --layers=false: one working container per stage, no intermediate commits (vfs copies every layer
    # in full). The build context is the repository itself, so .dockerignore is what users get.
    bah build --isolation chroot --layers=false --pull-never --format docker \
        --build-arg PYTHON_IMAGE="$BASE_IMAGE" --build-context torch-wheels="$wheels" \
        -t "$tag" -f "$REPO/Dockerfile" "$REPO" >&2
    echo "build_seconds=$((SECONDS - started))"
    # the layers as stored here (uncompressed): what a node's disk holds, `docker images`' SIZE
    echo "size_bytes=$(bah inspect --type image "$tag" | jq -r '.Manifest' | jq '[.layers[].size] | add')"
    echo "image=$tag"
}

mount_image() {
    local ctr
    ctr=$(bah from --pull-never "$1")
    bah mount "$ctr"
}

run() {
    local image=$1 root=$2
    shift 2
    local -a extra_env=() volumes=() args=()
    local name=biggraph tmp_dir=
    while [ $# -gt 0 ]; do
        case $1 in
            -e) extra_env+=("$2"); shift 2 ;;
            -v) volumes+=("$2"); shift 2 ;;
            --name) name=$2; shift 2 ;;
            --tmp) tmp_dir=$2; shift 2 ;;
            --) shift; args=("$@"); break ;;
            *) args=("$@"); break ;;
        esac
    done
    # the image's own configuration, as a container runtime reads it
    local config
    config=$(bah inspect --type image "$image" | jq '.OCIv1.config')
    local -a image_env entrypoint
    mapfile -t image_env < <(jq -r '.Env[]?' <<<"$config")
    mapfile -t entrypoint < <(jq -r '.Entrypoint[]?' <<<"$config")
    [ ${#args[@]} -gt 0 ] || mapfile -t args < <(jq -r '.Cmd[]?' <<<"$config")
    local user workdir
    user=$(jq -r '.User // "0:0"' <<<"$config")
    workdir=$(jq -r '.WorkingDir // "/"' <<<"$config")
    [ -n "$workdir" ] || workdir=/
    local uid=${user%%:*} gid=${user#*:}
    [ "$gid" != "$user" ] || gid=$uid
    # Mount points are created in the working container's own copy of the rootfs before it is made
    # read-only, as runc does; the image itself is not changed.
    local spec ctr_path
    for spec in "${volumes[@]}"; do
        ctr_path=$(cut -d: -f2 <<<"$spec")
        mkdir -p "$root$ctr_path"
    done
    touch "$root/etc/hosts" "$root/etc/resolv.conf"
    local mnt
    mnt=$(mktemp -d /tmp/biggraph-ctr.XXXXXX)
    # A private mount namespace: every mount below disappears with the process. Environment: the
    # image's ENV, then -e (as `docker run -e`), HOSTNAME as Kubernetes sets it; nothing from here.
    local rc=0
    env -i "${image_env[@]}" HOSTNAME="$name" "${extra_env[@]}" \
        unshare --mount --propagation private -- bash -c '
        set -e
        mnt=$1 root=$2 uid=$3 gid=$4 workdir=$5 tmp_dir=$6 nvol=$7; shift 7
        mount --bind "$root" "$mnt"
        mount -o remount,bind,ro "$mnt"
        mount --rbind /dev "$mnt/dev"
        mount -t tmpfs -o size=1g,mode=1777 shm "$mnt/dev/shm"
        mount -t proc proc "$mnt/proc"
        if [ -n "$tmp_dir" ]; then mount --bind "$tmp_dir" "$mnt/tmp"; else mount -t tmpfs -o size=2g,mode=1777 tmp "$mnt/tmp"; fi
        mount --bind /etc/hosts "$mnt/etc/hosts"
        mount --bind /etc/resolv.conf "$mnt/etc/resolv.conf"
        for _ in $(seq "$nvol"); do
            IFS=: read -r host ctr mode <<<"$1"; shift
            mount --bind "$host" "$mnt$ctr"
            [ "$mode" != ro ] || mount -o remount,bind,ro "$mnt$ctr"
        done
        # no_new_privs as allowPrivilegeEscalation: false; the uid switch drops every capability
        exec setpriv --no-new-privs unshare --root="$mnt" --wd="$workdir" --setgid "$gid" --setuid "$uid" -- "$@"
    ' bash "$mnt" "$root" "$uid" "$gid" "$workdir" "$tmp_dir" "${#volumes[@]}" "${volumes[@]}" "${entrypoint[@]}" "${args[@]}" \
        || rc=$?
    rmdir "$mnt"
    return "$rc"
}

clean() {
    [ -d "$STORE" ] || return 0
    bah rm --all >/dev/null
    if [ "${1:-}" = --all ]; then
        rm -rf "$STORE"
        return 0
    fi
    # everything but the base image, which a re-run would only import again
    local id base_id
    base_id=$(bah inspect --type image --format '{{.FromImageID}}' "$BASE_IMAGE" 2>/dev/null || true)
    for id in $(bah images --all --quiet --no-trunc); do
        [ "${id#sha256:}" = "${base_id#sha256:}" ] || bah rmi --force "$id" >/dev/null 2>&1 || true
    done
}

cmd=${1:-}
shift || true
case $cmd in
    deps) deps ;;
    base) deps; base ;;
    build) deps; base; build "$@" ;;
    mount) mount_image "$@" ;;
    run) run "$@" ;;
    clean) clean "$@" ;;
    *) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac
