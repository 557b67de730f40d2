from servingplan.llamacpp.profile import run_llamacpp_profile
from servingplan.pipeline import run_stage


def main(sm):
    profile = run_llamacpp_profile(sm.input.gguf, sm.params.profile, sm.params.llamacpp, sm.params.model["seed"],
                                   tiny=sm.params.model["tiny"])
    profile.write(sm.output.points, sm.output.samples, sm.output.machine)


run_stage(snakemake, main)
