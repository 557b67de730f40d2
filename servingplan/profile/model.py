"""Load the GPT-2 model that is profiled (and served): seeded random weights or a local checkpoint.

Random weights cost exactly what trained ones do on CPU (same shapes, same kernels, float32), and
need no model hub, which this project's machines cannot reach.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from servingplan.architecture import QUICK_CONFIG_OVERRIDES  # noqa: F401 - where loaders look for it

RANDOM_SOURCE = "random"


def load_model(source: str, seed: int, config_overrides: dict | None = None, device: str = "cpu"):
    """Return (model in eval mode on `device`, metadata dict).

    `source` is "random" (GPT2Config() defaults, i.e. GPT-2 small, changed by `config_overrides`,
    weights drawn after torch.manual_seed(seed)) or a local directory holding a transformers GPT-2
    checkpoint.
    """
    if source == RANDOM_SOURCE:
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(GPT2Config(**(config_overrides or {})))
    else:
        if config_overrides:
            raise ValueError(f"model source {source!r}: config overrides apply to random weights only")
        model = _load_checkpoint(Path(source))
    # weights are drawn (or read) on the CPU first, so a seed gives the same model on every device
    model = model.to(torch.float32).to(device).eval()
    return model, model_metadata(model, source, seed, config_overrides)


def _load_checkpoint(path: Path) -> GPT2LMHeadModel:
    problem = f"model source {str(path)!r}: not {RANDOM_SOURCE!r} and not a directory holding a GPT-2 checkpoint"
    if not (path / "config.json").is_file():
        raise ValueError(f"{problem} (no config.json)")
    try:
        config = GPT2Config.from_pretrained(path, local_files_only=True)
        if config.model_type != "gpt2":
            raise ValueError(f"model_type is {config.model_type!r}")
        return GPT2LMHeadModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except (OSError, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{problem} ({first_line})") from None


def unique_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters counted once: GPT-2 ties the LM head to the token embedding."""
    return list({p.data_ptr(): p for p in model.parameters()}.values())


def model_metadata(model: GPT2LMHeadModel, source: str, seed: int, config_overrides: dict | None) -> dict:
    config = model.config
    params = unique_parameters(model)
    embedding_params = model.transformer.wte.weight.numel() + model.transformer.wpe.weight.numel()
    param_count = sum(p.numel() for p in params)
    return {
        "source": source,
        "random_weights": source == RANDOM_SOURCE,
        "seed": seed if source == RANDOM_SOURCE else None,
        "config_overrides": dict(config_overrides or {}),
        "dtype": "float32",
        "device": str(next(model.parameters()).device),
        "param_count": param_count,
        "non_embedding_param_count": param_count - embedding_params,
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "n_inner": config.n_inner,
        "n_positions": config.n_positions,
        "vocab_size": config.vocab_size,
        "attn_implementation": config._attn_implementation,
    }
