"""Results pages: finished runs compared, offline and off the training path
(`python -m te_mixtral.results RUN [RUN ...]`).

    __main__.py    the command line
    runs.py        finished runs as the pages read them: results.json, checked on load
    compare.py     what a page compares, and what it refuses to
    pages.py       the dated markdown page and its plots
    reproduce.py   the command line that reproduces a run, from the config it saved
"""
