"""Exercise-2 serving simulator CLI; see servingplan/cli/main.py. Runs from a checkout, uninstalled."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from servingplan.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
