"""``python -m cenote serve ...``."""

from __future__ import annotations

from cenote.entrypoints.cli import main

if __name__ == "__main__":
    main()
