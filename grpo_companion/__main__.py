"""`python -m grpo_companion`: the book's command line (`grpo_companion.machinery.cli`)."""

import sys

from grpo_companion.machinery.cli import main

sys.exit(main())
