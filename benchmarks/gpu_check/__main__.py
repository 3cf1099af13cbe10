"""``python -m benchmarks.gpu_check``: see :mod:`benchmarks.gpu_check.driver`."""
import sys

from benchmarks.gpu_check.driver import main

sys.exit(main())
