"""``python -m minite_megatron.convert`` = ``minite-convert`` (see :mod:`.cli`)."""

import sys

from .cli import main

sys.exit(main())
