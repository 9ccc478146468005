"""`python -m meshcomm`: the same as the `meshcomm` command."""

from .cli import main

raise SystemExit(main())
