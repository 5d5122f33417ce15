#!/usr/bin/env bash
# `make locks`: writes the hash-pinned requirement files the Dockerfile installs from (requirements/*.txt) out of
# their inputs (pyproject.toml's extras, requirements/*.in), with uv's resolver.
#
#   requirements/build.txt      setuptools, the build backend that makes the disttrain wheel
#   requirements/operator.txt   disttrain[operator]'s dependencies                            (PyPI)
#   requirements/trainer.txt    disttrain[trainer,agent,s3]'s dependencies, torch's own deps   (PyPI)
#   requirements/torch-cpu.txt  torch's CPU wheel alone                                        (PyTorch's CPU index)
#   requirements/torch-cuda.txt torch's CUDA wheel and what it needs beyond trainer.txt:        (PyPI)
#                               nvidia-*, cuda-*, triton (`make image-cuda`, Linux x86-64 only)
#   requirements/uv.txt         the lock tool itself (this script installs it from there, hashes checked)
#
# Every file lists exact versions with the SHA-256 of every file PyPI (or the torch index) offers for them; the
# Dockerfile installs each with `pip install --require-hashes --no-deps`, so a file whose hash is not in the
# lock is refused whatever index serves it. Resolved for CPython 3.11 on Linux, the images' Python.
#
# Arguments go to every `uv pip compile`: `--upgrade` moves every pin to the newest allowed release (without it,
# pins already in a file are kept and only what the inputs changed is resolved again).
# TORCH_FIND_LINKS: where torch's CPU wheel is listed: the index page (default) records the hash of every wheel
# of the version (each Python, x86-64 and arm64); a local folder records the wheels in it only.
set -euo pipefail
cd "$(dirname "$0")/../.."

INDEX_URL="${INDEX_URL:-https://pypi.org/simple}"
TORCH_FIND_LINKS="${TORCH_FIND_LINKS:-https://download.pytorch.org/whl/cpu/torch/}"
venv=build/lock-venv

# The lock tool from its own lock, one index, hashes checked; no pip configuration file can add an index.
if [ ! -x "$venv/bin/uv" ] || ! cmp -s requirements/uv.txt "$venv/uv.txt"; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install --quiet --disable-pip-version-check --index-url "$INDEX_URL" \
        --require-hashes --no-deps -r requirements/uv.txt
    cp requirements/uv.txt "$venv/uv.txt"
fi

compile() {  # OUTPUT INPUT... [uv options]
    local out=$1
    shift
    # --no-config: no uv.toml or environment file adds an index; --native-tls: the system's CA bundle (a
    # TLS-inspecting proxy, as here, is trusted there only).
    UV_NATIVE_TLS=1 "$venv/bin/uv" pip compile --quiet --no-config --generate-hashes --python-version 3.11 \
        --python-platform linux --index-url "$INDEX_URL" --custom-compile-command "make locks" \
        --output-file "$out" "$@"
    echo "locks: $out ($(grep -c '^[a-z0-9]' "$out") packages)"
}

compile requirements/build.txt requirements/build.in "$@"
compile requirements/operator.txt pyproject.toml --extra operator "$@"
# trainer.txt and torch-cpu.txt come from one resolution (torch's dependencies are in the first, torch alone
# in the second: it comes from another index, in a pip call of its own; see the Dockerfile). The two files,
# joined, seed it so their pins are kept; uv records no hash for a lone `--no-deps` package, hence the split.
full="$venv/trainer-full.txt"
cat requirements/trainer.txt requirements/torch-cpu.txt > "$full" 2>/dev/null || : > "$full"
compile "$full" pyproject.toml requirements/torch-cpu.in --extra trainer --extra agent --extra s3 \
    --find-links "$TORCH_FIND_LINKS" "$@"
split() {  # KEEP_TORCH: 1 keeps torch's entry only, 0 everything else (the header goes to both)
    awk -v keep="$1" '/^[a-z0-9]/ {in_torch = ($0 ~ /^torch==/)} /^#/ && !seen {print; next} {seen = 1}
                      seen && in_torch == keep' "$full"
}
split 0 > requirements/trainer.txt
split 1 > requirements/torch-cpu.txt
grep -q -- '--hash=sha256:' requirements/torch-cpu.txt \
    || { echo "lock.sh: requirements/torch-cpu.txt: no torch entry with a hash (TORCH_FIND_LINKS=$TORCH_FIND_LINKS)" >&2; exit 1; }
# torch-cuda.txt: the same resolution with PyPI's torch (the CUDA build), held to trainer.txt's pins by taking that
# file as constraints (a CUDA dependency that needs another version of one of them fails here, not in the image);
# it keeps only what trainer.txt lacks, so the two files, joined, are the CUDA image's whole environment.
cuda_full="$venv/trainer-cuda-full.txt"
cat requirements/trainer.txt requirements/torch-cuda.txt > "$cuda_full" 2>/dev/null || : > "$cuda_full"
compile "$cuda_full" pyproject.toml requirements/torch-cuda.in --extra trainer --extra agent --extra s3 \
    --constraint requirements/trainer.txt "$@"
awk 'NR == FNR {if (/^[a-z0-9]/) {sub(/==.*/, ""); locked[$0] = 1}; next}
     /^[a-z0-9]/ {name = $1; sub(/==.*/, "", name); new = !(name in locked)} /^#/ && !seen {print; next} {seen = 1}
     seen && new' requirements/trainer.txt "$cuda_full" > requirements/torch-cuda.txt
grep -q -- '^torch==' requirements/torch-cuda.txt \
    || { echo "lock.sh: requirements/torch-cuda.txt: no torch entry" >&2; exit 1; }
compile requirements/uv.txt requirements/uv.in "$@"
