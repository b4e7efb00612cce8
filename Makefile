# The two things a user does first. Both install what they need.
.PHONY: demo test bench

demo:
	scripts/bootstrap.sh
	.venv/bin/elastic demo $(ARGS)

test:
	scripts/bootstrap.sh
	scripts/install-test-deps.sh
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25

bench:
	scripts/bootstrap.sh
	.venv/bin/elastic bench
