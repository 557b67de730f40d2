from servingplan.architecture import GPT2_SMALL
from servingplan.costmodel import load
from servingplan.io import read_json, write_csv, write_json
from servingplan.llamacpp.gguf_model import TINY_OVERRIDES
from servingplan.llamacpp.server_terms import run_server_terms
from servingplan.pipeline import run_stage


def main(sm):
    p = sm.params
    vocab_size = (TINY_OVERRIDES if p.model["tiny"] else GPT2_SMALL)["vocab_size"]
    pairs, terms, model = run_server_terms(sm.input.gguf, load(sm.input.costmodel), read_json(sm.input.profile),
                                           int(p.validation["cap"]), int(p.memory["max_context"]), p.model["seed"],
                                           p.server_log, vocab_size)
    write_csv(sm.output.pairs, pairs)
    write_json(sm.output.terms, terms)
    model.save(sm.output.costmodel)


run_stage(snakemake, main)
