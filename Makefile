# Thin wrappers: everything real lives in CMake, ctest and scripts/.
BUILD ?= build
JOBS ?= $(shell nproc)
PY := /usr/bin/python3

.PHONY: all deps build test demo bench soak fmt clean

all: build

deps:
	@scripts/install-deps

$(BUILD)/build.ninja: | deps
	cmake -S . -B $(BUILD) -G Ninja

build: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) $(CTEST_ARGS)

demo: build
	$(PY) scripts/demo.py --build $(BUILD)

bench: build
	scripts/bench-all --build $(BUILD)

# The pbox leak test at full length: 10,000 create/exec/destroy cycles (make test runs 250).
SOAK_CYCLES ?= 10000
soak: build
	PYTHONPATH=$(BUILD)/python PBOXD=$(BUILD)/src/pbox/pboxd PBOX_LEAK_CYCLES=$(SOAK_CYCLES) \
	  $(PY) -m pytest -q -s -p no:cacheprovider tests/pbox/python/test_leaks.py

fmt:
	git ls-files '*.cc' '*.h' | xargs clang-format -i

clean:
	rm -rf $(BUILD)
