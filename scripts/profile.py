from servingplan.pipeline import run_stage
from servingplan.profile.measure import run_profile


def main(sm):
    # Threads come from the config (0 = every core of this machine), never from snakemake's --cores,
    # which may exceed the machine's cores and would oversubscribe it while timing.
    profile = run_profile(sm.params.profile, sm.params.model, sm.params.seed)
    profile.write(sm.output.points, sm.output.samples, sm.output.machine)


run_stage(snakemake, main)
