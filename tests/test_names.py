"""Display names: every code name the pipeline writes has one, and an unknown name raises."""
import pytest

from servingplan.costmodel import CostModel
from servingplan.fit.step_model import DECODE_KINDS, PREFILL_KINDS
from servingplan.plan import names
from servingplan.profile.measure import REFERENCE_KINDS
from servingplan.simulate.fleet import ROUTERS
from servingplan.simulate.policies import POLICIES

TERMS = ["decode_fixed_s", "decode_per_seq_s", "decode_per_ctx_token_s", "prefill_fixed_s",
         "prefill_per_token_s", "prefill_per_token_sq_s", "prefill_per_token_ctx_s", "decode_batch_fixed_s"]


def _looks_like_code(text: str) -> bool:
    return "_" in text or text != text.strip() or not text


@pytest.mark.parametrize("code", TERMS + list(POLICIES) + list(ROUTERS) + list(REFERENCE_KINDS)
                         + list(PREFILL_KINDS + DECODE_KINDS)
                         + ["prefill_by_prompt_len", "prefill_by_cached", "decode_by_batch", "decode_by_cached",
                            "max_num_seqs", "cap", "chunk_size", "rate", "this machine"])
def test_every_code_name_has_a_readable_name(code):
    shown = names.display(code)
    assert shown != code or code == "this machine"
    assert not _looks_like_code(shown)


def test_every_costmodel_coefficient_has_a_name():
    coefficients = [f for f in CostModel.__dataclass_fields__ if f.endswith("_s")]
    assert coefficients, "the cost model's coefficient fields end in _s"
    for field in coefficients:
        assert not _looks_like_code(names.display(field))


def test_the_batch_cap_axis_reads_as_the_contract_says():
    assert names.display("max_num_seqs") == "batch cap (max concurrent sequences)"


def test_an_unknown_code_name_raises():
    with pytest.raises(KeyError, match="no display name for 'prefill_per_token_cube_s'"):
        names.display("prefill_per_token_cube_s")
    with pytest.raises(KeyError):
        names.display("laptop-ryzen7-7840u")          # a machine is known only through the config's list


def test_a_machine_reads_as_its_description_or_a_readable_form():
    hardware = [{"name": "laptop-ryzen7-7840u", "description": "Laptop-class CPU: AMD Ryzen 7 7840U (spec)"},
                {"name": "nvidia-t4"}, {"name": "gcp_a100-sxm", "description": ""}]
    assert names.display("laptop-ryzen7-7840u", hardware) == "Laptop-class CPU: AMD Ryzen 7 7840U (spec)"
    assert names.display("nvidia-t4", hardware) == "NVIDIA T4"
    assert names.display("gcp_a100-sxm", hardware) == "GCP A100 SXM"
    assert names.readable_machine("laptop-ryzen7-7840u") == "Laptop Ryzen7 7840U"
    assert names.brief(names.display("laptop-ryzen7-7840u", hardware)) == "Laptop-class CPU: AMD Ryzen 7 7840U"
    # a machine list does not hide the other tables
    assert names.display("decode_fixed_s", hardware) == names.TERMS["decode_fixed_s"]


def test_the_default_config_machines_have_names():
    from servingplan.config import load
    config = load("config.yaml")
    for entry in config.get("hardware", []):
        shown = names.display(entry["name"], config["hardware"])
        assert shown and shown != entry["name"]
