# Two commands on a fresh machine:  make demo  and  make test  (each installs first).
# make test-fast: the unit and single-process tests only (no multi-process or end-to-end runs), for the inner loop.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

DEMO_DATA := data/demo_en_ro
DEMO_MODEL := data/demo_t5
# the demo and the tests never touch the network
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export HF_EVALUATE_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo demo-data demo-model test test-fast clean

install: $(STAMP)

# torch first, pinned: its CPU build lies on local disk, while an unpinned torch pulled in by a
# dependency is a multi-GB CUDA download. Redone only when the package metadata changes.
$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test]' $(TORCH)
	touch $(STAMP)

$(DEMO_DATA)/train.source: | $(STAMP)
	$(PY) scripts/make_demo_data.py --out_dir $(DEMO_DATA)

$(DEMO_MODEL)/config.json: $(DEMO_DATA)/train.source
	$(PY) scripts/build_demo_model.py --data_dir $(DEMO_DATA) --out_dir $(DEMO_MODEL)

demo-data: $(DEMO_DATA)/train.source
demo-model: $(DEMO_MODEL)/config.json

# 2 processes on gloo, ZeRO-2 with the optimizer state offloaded to CPU RAM (configs/offload_cpu.json)
demo: install demo-model
	$(VENV)/bin/torchrun --standalone --nproc_per_node 2 scripts/finetune_trainer.py configs/demo.json

# everything: what CI runs. Two workers, each file on one of them (module fixtures are built once);
# the scripts' runs forked from a warm process per worker (tests/helpers/fork_server.py), the
# multi-rank checks on rank processes kept between tests (tests/distributed.py): pytest 7 min 49 s
# on 2 quiet cores (AMD EPYC) for 1,510 tests, 9 min 32 s before the ranks were kept
test: install
	$(PY) -m pytest -n 2 --dist loadfile

# unit and single-process tests: the markers are declared in setup.cfg
test-fast: install
	$(PY) -m pytest -m "not multiproc and not slow" -n 2

clean:
	rm -rf output/demo $(DEMO_DATA) $(DEMO_MODEL)
