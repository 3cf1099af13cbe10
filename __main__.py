"""``python -m tidal``: the tidal command line."""
from tidal.compiler.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
