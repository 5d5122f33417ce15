#!/usr/bin/env bash
# Makes a Python base image from Debian's own packages and prints its name, for builds where no image registry
# is reachable (this project's CI): debootstrap a minimal Debian into a folder, then commit it with buildah.
# Its python3 is CPython 3.11 (bookworm), like python:3.11-slim, the Dockerfile's default base.
#
# The image name carries a hash of every input (suite, mirror, packages, this script), so a second run finds it
# in buildah's local storage and returns at once; changing an input makes a new image.
#
# What pins it (a registry digest cannot: the image is made here, and debootstrap's output differs by timestamps
# from run to run): debootstrap checks the suite's Release file against Debian's archive keyring and every
# package against the Release's SHA-256 sums (--force-check-gpg: no keyring, no image), and the script prints
# the image by its digest, NAME@sha256:..., which build.sh hands the Dockerfile as PYTHON_IMAGE: the build uses
# exactly the image verified here, not whatever holds the tag by then.
set -euo pipefail

SUITE="${DEBIAN_SUITE:-bookworm}"
# python3-venv: the Dockerfile installs into a venv (it brings pip's wheel); ca-certificates: pip reaches PyPI.
PACKAGES="python3-venv,ca-certificates"

# The mirror this machine's apt uses (deb822 sources or the one-line format), so no other host is contacted.
apt_mirror() {
    local uri
    uri=$(awk '/^URIs:/ {for (i = 2; i <= NF; i++) if ($i ~ /\/debian\/?$/) {print $i; exit}}' \
        /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)
    [ -n "$uri" ] || uri=$(awk '$1 == "deb" && $2 !~ /^\[/ && $2 ~ /\/debian\/?$/ {print $2; exit}' \
        /etc/apt/sources.list 2>/dev/null)
    echo "${uri:-http://deb.debian.org/debian}"
}
MIRROR="${DEBIAN_MIRROR:-$(apt_mirror)}"
KEYRING="${DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}"

# The image's reference by the digest of its manifest: a tag can be moved, a digest names one content.
by_digest() {  # NAME
    local digest
    digest=$(buildah inspect --type image --format '{{.FromImageDigest}}' "$1")
    case "$digest" in
        sha256:*) echo "${1%:*}@$digest" ;;
        *) echo "base.sh: $1 has no manifest digest (got '$digest')" >&2; return 1 ;;
    esac
}

key=$(printf '%s\n' "$SUITE" "$MIRROR" "$PACKAGES" "$(sha256sum < "$KEYRING" 2>/dev/null)" "$(sha256sum < "$0")" | sha256sum | cut -c1-12)
name="localhost/disttrain-base:${SUITE}-${key}"
if buildah inspect --type image "$name" >/dev/null 2>&1; then
    by_digest "$name"
    exit 0
fi

command -v debootstrap >/dev/null || { echo "base.sh: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
[ -f "$KEYRING" ] || { echo "base.sh: DEBIAN_KEYRING=$KEYRING: no such file; debootstrap verifies the Debian archive's signature with it (apt-get install debian-archive-keyring)" >&2; exit 1; }
work=$(mktemp -d)
ctr=""
trap 'rm -rf "$work"; [ -z "$ctr" ] || buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
echo "base.sh: debootstrap $SUITE from $MIRROR (a few minutes)" >&2
debootstrap --variant=minbase --force-check-gpg --keyring="$KEYRING" --include="$PACKAGES" "$SUITE" "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }
# Downloaded packages and package lists: ~95 MB nobody needs at run time (`apt-get update` brings lists back).
rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
# A tar keeps what a plain copy may not: owners, modes (/tmp's sticky bit), device nodes, hard links.
tar -C "$work/rootfs" --numeric-owner -cf "$work/rootfs.tar" .
ctr=$(buildah from scratch)
buildah add "$ctr" "$work/rootfs.tar" / >/dev/null  # ADD unpacks a local tar archive
buildah config --env LANG=C.UTF-8 --cmd python3 \
    --label "org.opencontainers.image.description=Debian $SUITE minbase + $PACKAGES (debootstrap from $MIRROR)" "$ctr"
buildah commit --quiet --rm "$ctr" "$name" >/dev/null
ctr=""
by_digest "$name"
