# The two things a user does first. Both install what they need.
.PHONY: demo test bench docs

demo:
	scripts/bootstrap.sh
	.venv/bin/elastic demo $(ARGS)

test:
	scripts/bootstrap.sh
	scripts/install-test-deps.sh
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 -m "not fuzz and (not slurm or slurm_core or slurm_host)"
	scripts/test-slurm-releases.sh

bench:
	scripts/bootstrap.sh
	.venv/bin/elastic bench

# The user's guide (docs/, mkdocs.yml) into site/; --strict: a broken link or reference fails the build
docs:
	scripts/install-docs-deps.sh
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
