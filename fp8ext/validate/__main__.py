"""python -m fp8ext.validate: see fp8ext/validate/__init__.py."""

import sys

from . import main

sys.exit(main())
