# The course in two commands: `make lab` (set up, open JupyterLab) and `make test` (set up, run every test).
PY ?= python3
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-installed
NOTEBOOK_TIMEOUT ?= 300

.PHONY: setup lab format-notebooks reset-notebooks test test-unit test-notebooks test-load slides slides-figures doctor bench bench-nodes clean \
	tensorflow test-tensorflow deepspeed test-deepspeed test-torch gpu-kit \
	slurm-packages slurm-cluster slurm-cluster-stop test-slurm classroom class-server class-server-stop test-class-server test-grading

# Reinstalls only when the pinned requirements or the package metadata change. CPU_ONLY=1 (on a new .venv) takes
# torch and torchvision at requirements.txt's pins from PyTorch's CPU index first: no CUDA libraries (see README).
CPU_ONLY ?=
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_PINS = $(shell grep -E '^torch(vision)?==' requirements.txt)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(if $(filter 1,$(CPU_ONLY)),$(PYTHON) -m pip install -q $(TORCH_PINS) --index-url $(TORCH_CPU_INDEX))
	$(PYTHON) -m pip install -q -r requirements.txt
	$(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	$(PYTHON) -m ipykernel install --sys-prefix --name labsrc --display-name "Python (labsrc course)" >/dev/null
	touch $(STAMP)

setup: $(STAMP)

# JupyterLab refuses root without --allow-root (many GPU servers and containers run as root); a headless
# server (an ssh session, or Linux without a display) gets no browser, and the ssh tunnel line to reach it.
LAB_PORT ?= 8888
LAB_ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)
LAB_HEADLESS := $(or $(SSH_CONNECTION),$(if $(or $(DISPLAY),$(WAYLAND_DISPLAY),$(filter Darwin,$(shell uname -s))),,yes))
LAB_BROWSER_FLAG := $(if $(LAB_HEADLESS),--no-browser)

# The repository root is served (the notebooks' links reach docs/, labsrc/, solutions/ and runs/) and the README
# opens first, rendered; jupyter/settings/ turns off the news pop-up; only the course's kernels are offered (the
# venv's own "python3" is the same interpreter under another name).
LAB_FLAGS := --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/README.md \
	--LabApp.app_settings_dir="$(CURDIR)/jupyter/settings" \
	--KernelSpecManager.allowed_kernelspecs=labsrc --KernelSpecManager.allowed_kernelspecs=labsrc-tf \
	--MappingKernelManager.default_kernel_name=labsrc

lab: setup
	$(PYTHON) -m labsrc.doctor || true
	@echo "JupyterLab listens on 127.0.0.1:$(LAB_PORT) (LAB_PORT=... to change it; if taken, Jupyter picks the next free port)."
	@echo "On a remote server, run on your own computer:  ssh -N -L $(LAB_PORT):127.0.0.1:$(LAB_PORT) $${USER:-you}@$$(hostname -f 2>/dev/null || hostname)"
	@echo "then open the http://127.0.0.1:$(LAB_PORT)/lab/tree/README.md?token=... address Jupyter prints below."
	$(VENV)/bin/jupyter lab $(LAB_FLAGS) --ip=127.0.0.1 --port=$(LAB_PORT) $(LAB_ROOT_FLAG) $(LAB_BROWSER_FLAG)

# Stores every notebook as JupyterLab saves it with the course's kernel (tests/test_notebook_format.py checks);
# PYTHON_VERSION=3.12.3 stamps a class server's own Python instead of the course's 3.11.7 (see README).
format-notebooks: setup
	$(PYTHON) tools/notebook_format.py $(if $(PYTHON_VERSION),--python-version $(PYTHON_VERSION))

# The course's notebooks back as committed; each changed one is first copied to saved_work/<date>-<time>/.
reset-notebooks: setup
	$(PYTHON) tools/notebook_reset.py

# The extras' tests (an emulated Slurm cluster, the class server, grading) run in their own targets, which install what they need: `make test`
# leaves them out so a machine that has them installed does not run them twice in CI.
EXTRA_TESTS := --ignore=tests/test_slurm_cluster.py --ignore=tests/test_class_server.py --ignore=tests/test_grading.py

test: setup
	LABSRC_PROFILE=ci LABSRC_HEADLESS=1 MPLBACKEND=Agg $(PYTHON) -m pytest tests notebooks $(EXTRA_TESTS) \
		--nbmake --nbmake-timeout=$(NOTEBOOK_TIMEOUT) --durations=15

test-unit: setup
	LABSRC_PROFILE=ci LABSRC_HEADLESS=1 MPLBACKEND=Agg $(PYTHON) -m pytest tests $(EXTRA_TESTS)

test-notebooks: setup
	LABSRC_PROFILE=ci LABSRC_HEADLESS=1 MPLBACKEND=Agg $(PYTHON) -m pytest notebooks \
		--nbmake --nbmake-timeout=$(NOTEBOOK_TIMEOUT)

# The notebooks under classroom load (tools/load_harness.py; not part of `make test`): RUNS runs of each of NOTEBOOKS
# (numbers; empty: all) while LOAD busy processes per core (factors, e.g. 2,4,8) run beside a neighbour running
# NEIGHBOUR in a loop (empty: no neighbour). A table per load; results in runs/load/<timestamp>/.
LOAD ?= 2,4,8
RUNS ?= 3
NOTEBOOKS ?=
NEIGHBOUR ?= 01 04
test-load: setup
	$(PYTHON) tools/load_harness.py --load $(LOAD) --runs $(RUNS) $(if $(strip $(NOTEBOOKS)),--notebooks $(NOTEBOOKS)) \
		$(if $(strip $(NEIGHBOUR)),--neighbour $(NEIGHBOUR))

# A real Slurm cluster of two emulated nodes on this machine (labsrc/nodes/slurm_cluster.py; cluster/README.md):
# Debian's slurm-wlm and munge, installed here as root when missing; otherwise say what to do.
slurm-packages:
	@if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null) \
			|| echo "slurm-wlm and munge could not be installed: the Slurm tests will skip"; \
	else echo "Slurm is not installed: as root on Debian/Ubuntu run  apt-get install -y slurm-wlm munge  (the emulated cluster needs root)."; fi

slurm-cluster: setup slurm-packages
	$(PYTHON) -m labsrc.lessons.elastic_fault_tolerance.membership_slurm

slurm-cluster-stop: setup
	$(PYTHON) -m labsrc.lessons.elastic_fault_tolerance.membership_slurm --stop

test-slurm: setup slurm-packages
	LABSRC_PROFILE=ci LABSRC_HEADLESS=1 MPLBACKEND=Agg $(PYTHON) -m pytest tests/test_slurm_cluster.py -rs --durations=10

# A class server (cluster/classroom/, labsrc/classroom/server.py; INSTRUCTORS.md section 2): JupyterHub, its idle
# culler and nbgrader added to the course's venv, and configurable-http-proxy from npm into .classroom/proxy.
# As root: the students' accounts come from the roster; the hub listens on loopback unless the settings open it.
CLASSROOM_SETTINGS ?= cluster/classroom/classroom.toml
CLASSROOM_PROXY := .classroom/proxy/node_modules/.bin/configurable-http-proxy

$(VENV)/.stamp-classroom: requirements-classroom.txt $(STAMP)
	$(PYTHON) -m pip install -q -r requirements-classroom.txt
	touch $@

$(CLASSROOM_PROXY):
	@command -v npm >/dev/null || { echo "configurable-http-proxy needs Node 18+ and npm: apt-get install -y nodejs npm"; exit 2; }
	npm install --prefix .classroom/proxy --no-audit --no-fund --loglevel=error configurable-http-proxy@5.3.0

# setfacl (Debian's acl) for grant_group_traverse: lets the students' group pass through e.g. /root to the venv.
classroom: $(VENV)/.stamp-classroom $(CLASSROOM_PROXY)
	@command -v setfacl >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq acl >/dev/null); } \
		|| echo "setfacl is missing (apt-get install -y acl): grant_group_traverse will not work"

class-server: classroom
	$(PYTHON) -m labsrc.classroom.server start --settings $(CLASSROOM_SETTINGS)

class-server-stop: setup
	$(PYTHON) -m labsrc.classroom.server stop --settings $(CLASSROOM_SETTINGS)

test-class-server: classroom
	LABSRC_PROFILE=ci LABSRC_HEADLESS=1 MPLBACKEND=Agg $(PYTHON) -m pytest tests/test_class_server.py -rs --durations=10

slides: setup
	$(PYTHON) slides/build.py

# Redraws slides/figures/*.png from ci runs of every lab (a few minutes), then builds the decks.
slides-figures: setup
	MPLBACKEND=Agg $(PYTHON) slides/figures.py
	$(PYTHON) slides/build.py

# Optional extras, each apart from the default set-up.
# TensorFlow (the appendix to notebook 13): its own environment .venv-tf and Jupyter kernel "labsrc-tf".
TF_VENV := .venv-tf
$(TF_VENV)/.stamp-installed: requirements-tensorflow.txt
	test -x $(TF_VENV)/bin/python || $(PY) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install -q -r requirements-tensorflow.txt
	$(TF_VENV)/bin/python -m ipykernel install --user --name labsrc-tf --display-name "Python (labsrc TensorFlow)" >/dev/null
	touch $@

tensorflow: $(TF_VENV)/.stamp-installed

test-tensorflow: tensorflow
	MPLBACKEND=Agg $(TF_VENV)/bin/python -m pytest tests_tensorflow appendix/13_tensorflow_mirrored.ipynb \
		--nbmake --nbmake-timeout=$(NOTEBOOK_TIMEOUT)

# DeepSpeed (notebook 09's last section): added to the course's venv; without it those cells skip. Its CPU
# accelerator compiles one C++ op (shared-memory communication, with c++ and ninja) on first use whatever
# DS_BUILD_OPS says: it is built here once, so a training run does not compile under its timeout.
deepspeed: setup
	DS_BUILD_OPS=0 $(PYTHON) -m pip install -q -r requirements-deepspeed.txt
	DS_ACCELERATOR=cpu $(PYTHON) -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()"

test-deepspeed: deepspeed
	DS_ACCELERATOR=cpu LABSRC_PROFILE=ci $(PYTHON) -m pytest tests/test_deepspeed.py

# Exercises collected and graded with nbgrader (INSTRUCTORS.md section 5, "Grading"): the classroom extra added
# to the course's venv, then the flow end to end for two students (real system users as root).
test-grading: classroom
	LABSRC_PROFILE=ci LABSRC_HEADLESS=1 MPLBACKEND=Agg $(PYTHON) -m pytest tests/test_grading.py

# The course on another torch of the range it supports (2.11 through 2.14): its own venv .venv-torch<version>
# (torchvision 0.<minor + 15>.<patch>: torchvision pins its torch), then every unit test and notebook, as `make test` runs them.
TORCH ?= 2.11.0
TORCH_VENV = .venv-torch$(TORCH)
TORCHVISION_FOR_TORCH = 0.$(shell echo $$(( $(word 2,$(subst ., ,$(TORCH))) + 15 ))).$(word 3,$(subst ., ,$(TORCH)))

$(TORCH_VENV)/.stamp-installed: requirements.txt
	test -x $(TORCH_VENV)/bin/python || $(PY) -m venv $(TORCH_VENV)
	$(TORCH_VENV)/bin/python -m pip install -q torch==$(TORCH) torchvision==$(TORCHVISION_FOR_TORCH) \
		$$(grep -vE '^(torch|torchvision)==|^#' requirements.txt | sed 's/ *#.*//')
	$(TORCH_VENV)/bin/python -c "import pathlib, sysconfig; pathlib.Path(sysconfig.get_paths()['purelib'], \
		'labsrc-checkout.pth').write_text('$(CURDIR)\n')"
	$(TORCH_VENV)/bin/python -m ipykernel install --sys-prefix --name labsrc --display-name "Python (labsrc, torch $(TORCH))" >/dev/null
	touch $@

test-torch: $(TORCH_VENV)/.stamp-installed
	LABSRC_PROFILE=ci LABSRC_HEADLESS=1 MPLBACKEND=Agg $(TORCH_VENV)/bin/python -m pytest tests notebooks \
		--nbmake --nbmake-kernel=labsrc --nbmake-timeout=$(NOTEBOOK_TIMEOUT) -p no:cacheprovider --durations=10

# The GPU truth kit (tools/gpu_truth.sh; results/gpu/README.md): the wheels the GPU machine lacks, for its Python.
gpu-kit: setup
	$(PYTHON) tools/gpu_kit.py --python-version 3.12

doctor: setup
	$(PYTHON) -m labsrc.doctor

bench: setup
	$(PYTHON) -m labsrc.bench --compare-loop

# Emulated nodes (root or user namespaces): the link's throughput and the all-reduce models at 1 Gbit/s and 100 Mbit/s.
bench-nodes: setup
	$(PYTHON) -m labsrc.bench nodes

clean:
	rm -rf runs slides/build .pytest_cache $(TF_VENV)
