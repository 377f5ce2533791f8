"""Before a long run: ``ds-trhash preflight`` (will this launch reach its end here?) and
``ds-trhash smoke`` (the stage at its real size for a few steps, with a projection of the full
run). Beside cli.py and demo.py: imports training (its launch plan's public names), eval and
release; only cli.py imports it."""
