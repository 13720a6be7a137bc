"""``python -m fastckpt COMMAND``: the same as the ``fastckpt`` console script."""

from fastckpt.cli import main

raise SystemExit(main())
