from servingplan.io import atomic_path
from servingplan.llamacpp.gguf_model import make_gguf
from servingplan.pipeline import run_stage


def main(sm):
    with atomic_path(sm.output.gguf) as tmp:
        make_gguf(tmp, sm.params.model["seed"], sm.params.model["tiny"], work_dir=tmp.parent)


run_stage(snakemake, main)
