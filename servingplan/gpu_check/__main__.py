"""python -m servingplan.gpu_check: see servingplan/gpu_check/run.py."""
from servingplan.gpu_check.run import main
from servingplan.io import quiet_on_closed_pipe

raise SystemExit(quiet_on_closed_pipe(main)())
