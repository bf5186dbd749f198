"""`python -m te_mixtral.results RUN [RUN ...]`: write results pages (see `pages.py`)."""

import sys

from te_mixtral.results.pages import main

sys.exit(main())
