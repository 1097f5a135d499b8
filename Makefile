# labkit — the two commands a newcomer needs:
#   make lab    set up .venv (first time: a few minutes) and open JupyterLab on the course
#   make test   set up .venv and run the whole test suite
PY := .venv/bin/python
# root (a container, a fresh VM) needs jupyter's explicit consent
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: setup lab test bench wheelhouse clean

setup:
	@bash scripts/setup.sh

lab: setup
	$(PY) -m jupyter lab --notebook-dir=notebooks $(ROOT_FLAG)

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/bench_data_parallel.py

# a workshop: every wheel the lab needs in wheelhouse/, for laptops that install offline (docs/workshop.md)
wheelhouse:
	@bash scripts/wheelhouse.sh

clean:
	rm -rf .venv build *.egg-info
