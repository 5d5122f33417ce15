#!/usr/bin/env bash
# `make images`: builds the Dockerfile's `operator` and `trainer` targets with buildah (no daemon, no registry).
# `build.sh TARGET [OPTION...]` builds one target, the `buildah bud` options after it added: `make image-cuda` builds
# trainer-cuda so, with the build arguments that choose the CUDA torch lock (its wheels come from PyPI in the build).
#   - base: a Debian image made by scripts/images/base.sh (or PYTHON_IMAGE, if it is already in local storage),
#     handed to the build by its digest (NAME@sha256:...);
#   - torch: the CPU wheel of requirements/torch-cpu.txt, taken by the host's pip (here a local file) with its
#     hash checked, and mounted into the build read-only (never a layer of the images); the build checks the hash
#     again. Every other package comes from PyPI, each checked against its lock (requirements/*.txt).
# Prints the build time of each target and the image sizes. IMAGE_TAG (default latest) names the images
# localhost/disttrain-TARGET:TAG.
set -euo pipefail
cd "$(dirname "$0")/../.."

TAG="${IMAGE_TAG:-latest}"
PIP="${PIP:-python3 -m pip}"
command -v buildah >/dev/null || { echo "build.sh: buildah is not installed (apt-get install buildah)" >&2; exit 1; }

# The base by its digest: a tag in local storage can be moved between here and the build, a digest cannot.
base="${PYTHON_IMAGE:-$(scripts/images/base.sh)}"
if [[ "$base" != *@sha256:* ]]; then
    digest=$(buildah inspect --type image --format '{{.FromImageDigest}}' "$base")
    [[ "$digest" == sha256:* ]] || { echo "build.sh: PYTHON_IMAGE=$base: no digest in local storage" >&2; exit 1; }
    name="$base"
    [[ "${base##*/}" == *:* ]] && name="${base%:*}"  # the tag goes; a registry's :port stays
    base="$name@$digest"
fi
echo "images: base $base"

# Where PyPI is reached through a TLS-inspecting proxy (as here), only the host's CA bundle trusts it: lend that
# bundle to the RUN steps as a read-only mount over the base's own, so the images keep Debian's.
ca="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
ca_mount=()
[ -f "$ca" ] && ca_mount=(--volume "$(realpath "$ca"):/etc/ssl/certs/ca-certificates.crt:ro")

bud() {  # TARGET [buildah bud options...]
    local target=$1 start=$SECONDS
    shift
    # --layers: a rebuild with nothing changed reuses every step; --pull=never: the base is local, never fetched;
    # --force-rm: a failed step leaves no working container (a copy of the image's filesystem) behind.
    buildah bud --quiet --isolation chroot --layers --pull=never --force-rm --target "$target" \
        --build-arg PYTHON_IMAGE="$base" -t "localhost/disttrain-$target:$TAG" "${ca_mount[@]}" "$@" . >/dev/null
    echo "images: $target built in $((SECONDS - start)) s"
}
if [ $# -gt 0 ]; then
    targets=("$1")
    bud "$@"
else
    targets=(operator trainer)
    # torch's CPU wheel, its hash checked against the lock before it goes anywhere near the build.
    wheels="$PWD/build/wheels"
    rm -rf "$wheels"
    mkdir -p "$wheels"
    $PIP download --quiet --no-deps --require-hashes --dest "$wheels" -r requirements/torch-cpu.txt
    bud operator
    # Mounted at /mnt, a folder every Debian image has: a mount point buildah had to create would stay behind, empty,
    # in the layer of every RUN step, the images' included.
    bud trainer --volume "$wheels:/mnt:ro" --build-arg TORCH_FIND_LINKS=/mnt
fi
names=$(IFS='|'; echo "${targets[*]}")
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E "^localhost/disttrain-($names):$TAG " \
    | sed 's/^/images: /'
