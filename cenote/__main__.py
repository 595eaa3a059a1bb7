"""``python -m cenote serve ...``."""

from __future__ import annotations

from cenote.cli.main import main

if __name__ == "__main__":
    main()
