"""``python -m amdxdna_direct.cli``: same as the ``amdxdna`` command."""

from amdxdna_direct.cli import main

raise SystemExit(main())
