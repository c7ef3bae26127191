"""``python -m specdecode``: the ``specdecode`` command."""

from specdecode.cli import main

raise SystemExit(main())
