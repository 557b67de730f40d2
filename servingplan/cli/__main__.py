"""python -m servingplan.cli: see servingplan/cli/main.py."""
from servingplan.cli.main import main

raise SystemExit(main())
