"""The sizes the config check computes from the architecture alone match the models really built."""
import json

import pytest
from transformers import GPT2Config

from servingplan import architecture
from servingplan.profile.model import load_model


def test_gpt2_small_is_gpt2configs_defaults():
    defaults = GPT2Config()
    assert {key: getattr(defaults, key) for key in architecture.GPT2_SMALL} == architecture.GPT2_SMALL


@pytest.mark.parametrize("model_cfg", [{"source": "random"}, {"source": "random", "tiny": True}])
def test_weight_and_kv_sizes_match_the_loaded_model(model_cfg):
    arch = architecture.architecture(model_cfg)
    model, meta = load_model("random", 0, architecture.QUICK_CONFIG_OVERRIDES if model_cfg.get("tiny") else None)
    assert architecture.weight_count(arch) == meta["param_count"]
    assert architecture.weight_bytes(arch) == meta["param_bytes"]
    assert architecture.kv_bytes_per_token(arch) == 2 * meta["n_layer"] * meta["n_embd"] * 4
    assert arch["n_positions"] == meta["n_positions"]


def test_a_checkpoints_config_json_gives_its_shape(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": 3, "n_embd": 96, "n_head": 4, "n_inner": 200}))
    arch = architecture.architecture({"source": str(tmp_path)})
    model, meta = load_model("random", 0, {"n_layer": 3, "n_embd": 96, "n_head": 4, "n_inner": 200})
    assert architecture.weight_count(arch) == meta["param_count"]


def test_a_checkpoint_with_a_nonsense_shape_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"n_layer": "twelve"}))
    with pytest.raises(ValueError, match="n_layer = 'twelve': must be a positive integer"):
        architecture.architecture({"source": str(tmp_path)})
