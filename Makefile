# make test: the test suite in a private virtual environment (.venv), created on first use.
# make test-fast: the same without the tests marked slow or root, for the edit loop.
# make deb: build dist/cudawrap_VERSION_ARCH.deb (dh + dh-virtualenv; see debian/rules).
# make packaging: regenerate packaging/ from the code (completion, units, tmpfiles entry, man pages).
# make docs: the documentation site, built strictly into build/site (open build/site/index.html).

PYTHON ?= python3
VENV ?= .venv
PYTEST_ARGS ?=
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.cudawrap-installed

.PHONY: test test-fast venv packaging completion docs deb clean

# -ra: the summary names every skip with its reason (CI must have none), besides failures and
# xfails; a bare -rs would replace pyproject's -ra and drop the FAILED lines.
# lint-imports: the package's layers (pyproject's [tool.importlinter]) before the tests.
# -n 2: two halves side by side, one worker each (tests/conftest.py says which).
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VPY) -m pytest -q -ra -n 2 $(PYTEST_ARGS)

# The edit loop: all but the slow tests and those needing root (CI still runs everything).
test-fast: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VPY) -m pytest -q -ra -m "not slow and not root" $(PYTEST_ARGS)

venv: $(STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV)

# Reinstalled when the package's metadata changes; the code itself is an editable install.
# docs: mkdocs and its theme, for tests/test_docs.py's strict build of the site.
$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q -e '.[test,docs]'
	@touch $@

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict

packaging: $(STAMP)
	$(VPY) -m cudawrap.cli.installer render-completion > packaging/cudawrap.bash-completion.tmp
	$(VPY) -m cudawrap.cli.installer render-unit > packaging/cudawrap-sync.service.tmp
	$(VPY) -m cudawrap.cli.installer render-monitor-unit > packaging/cudawrap-monitor.service.tmp
	$(VPY) -m cudawrap.cli.installer render-mps-unit > packaging/cudawrap-mps.service.tmp
	$(VPY) -m cudawrap.cli.installer render-service-unit > packaging/cudawrap.service.tmp
	$(VPY) -m cudawrap.cli.installer render-tmpfiles > packaging/cudawrap.tmpfiles.tmp
	for f in cudawrap.bash-completion cudawrap-sync.service cudawrap-monitor.service cudawrap-mps.service \
		cudawrap.service cudawrap.tmpfiles; do \
		mv packaging/$$f.tmp packaging/$$f; done
	mkdir -p packaging/man
	for page in cudawrap.1 create-cudawrap.8 cudawrap.toml.5; do \
		$(VPY) -m cudawrap.cli.installer render-man-$$page > packaging/man/$$page.tmp && \
		mv packaging/man/$$page.tmp packaging/man/$$page; done

completion: packaging

# Built in a copy under build/deb, so the checkout is never changed (dpkg-buildpackage
# writes next to the source directory). Needs debhelper, dh-virtualenv, python3-venv.
deb:
	rm -rf build/deb && mkdir -p build/deb/cudawrap dist
	tar -cf - --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./dist \
		--exclude='*.egg-info' --exclude=__pycache__ --exclude=./.pytest_cache --exclude=./.whl \
		--exclude=./bench/results . | tar -C build/deb/cudawrap -xf -
	# The commit, for `cudawrap --version` (debian/rules reads it; the copy has no .git).
	-commit=$$(git -c safe.directory="$(CURDIR)" rev-parse --short=12 HEAD 2>/dev/null) && \
		if [ -n "$$(git -c safe.directory="$(CURDIR)" status --porcelain --untracked-files=no)" ]; then \
		commit="$$commit with uncommitted changes"; fi && echo "$$commit" > build/deb/cudawrap/debian/build-commit
	cd build/deb/cudawrap && dpkg-buildpackage -b -us -uc
	rm -f dist/cudawrap_*.deb
	cp build/deb/cudawrap_*.deb dist/
	@ls dist/cudawrap_*.deb

clean:
	rm -rf build dist .pytest_cache
