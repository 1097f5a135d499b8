"""``python -m labkit`` works like the ``labkit`` command:

    python -m labkit run --engines 2 --dp 2 --steps 3
"""
import sys

from .cli import main

sys.exit(main())
