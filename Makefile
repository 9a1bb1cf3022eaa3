# make test: the test suite in a private virtual environment (.venv), created on first use.
# make packaging: regenerate packaging/ from the code (completion, boot unit, tmpfiles entry).

PYTHON ?= python3
VENV ?= .venv
PYTEST_ARGS ?=
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.cudawrap-installed

.PHONY: test venv packaging completion clean

# -ra: the summary names every skip with its reason (CI must have none), besides failures and
# xfails; a bare -rs would replace pyproject's -ra and drop the FAILED lines.
test: $(STAMP)
	$(VPY) -m pytest -q -ra $(PYTEST_ARGS)

venv: $(STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV)

# Reinstalled when the package's metadata changes; the code itself is an editable install.
$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q -e '.[test]'
	@touch $@

packaging: $(STAMP)
	$(VPY) -m cudawrap.installation render-completion > packaging/cudawrap.bash-completion.tmp
	$(VPY) -m cudawrap.installation render-unit > packaging/cudawrap-sync.service.tmp
	$(VPY) -m cudawrap.installation render-monitor-unit > packaging/cudawrap-monitor.service.tmp
	$(VPY) -m cudawrap.installation render-tmpfiles > packaging/cudawrap.tmpfiles.tmp
	for f in cudawrap.bash-completion cudawrap-sync.service cudawrap-monitor.service cudawrap.tmpfiles; do \
		mv packaging/$$f.tmp packaging/$$f; done

completion: packaging

clean:
	rm -rf build dist .pytest_cache
