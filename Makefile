# The two commands of the README. Both set everything up on first use.
.PHONY: serve test setup

PORT ?= 8000

setup:
	@scripts/setup.sh

serve: setup
	@PORT=$(PORT) scripts/serve.sh

test: setup
	@scripts/test.sh $(ARGS)
