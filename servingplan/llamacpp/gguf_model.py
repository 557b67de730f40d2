"""The seeded GPT-2 as a GGUF file for llama.cpp, converted by the pinned sdist's convert_hf_to_gguf.py.

Two workarounds (issue 22):
- transformers 5 leaves `n_ctx` out of config.json, which the converter's GPT-2 reads: it is written back
  (= n_positions).
- The converter needs a tokenizer and recognises its pre-tokenizer by hashing an encoded test string; with
  no hub there is no GPT-2 tokenizer, so a synthetic byte-level BPE of the model's vocabulary size is saved
  and the pre-tokenizer check is told "gpt-2". Only token ids are ever sent to llama-server, so the
  tokenizer's content does not matter.
The converter imports `gguf` from the sdist's own gguf-py (nothing to install); it needs torch, numpy,
transformers, tokenizers, tqdm, pyyaml and requests, all in requirements.txt or pulled in by them.

    python -m servingplan.llamacpp.gguf_model OUT.gguf [--tiny] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from servingplan.llamacpp import build

# a model for tests: 2 layers, 64 wide, 512-token vocabulary, 256 positions (a 1 MB GGUF)
TINY_OVERRIDES = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 512, "n_positions": 256}


# the printable ASCII characters byte-level BPE writes as themselves ('!' to '~'; not the space, which it
# writes as 'Ġ')
PRINTABLE = [chr(code) for code in range(33, 127)]


def synthetic_tokenizer(vocab_size: int):
    """A byte-level BPE with exactly `vocab_size` tokens, <|endoftext|> last as GPT-2 has it, wrapped for
    transformers. Every other token is printable ASCII: the single characters, then merges of a token
    with one more character (pairs, then triples, ...). A token that decodes to part of a UTF-8 character
    (as GPT-2's single bytes 0x80-0xFF do) would make llama-server hold back every later token of the
    reply until the character completed, and with random weights it never might: the streaming client
    would then stamp those tokens late."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(PRINTABLE) + 1:
        raise ValueError(f"vocab_size={vocab_size}: the synthetic tokenizer needs at least {len(PRINTABLE) + 1}")
    vocab = {tok: i for i, tok in enumerate(PRINTABLE)}
    merges = []
    stems = list(PRINTABLE)
    while len(vocab) < vocab_size - 1:
        longer = []
        for stem in stems:
            for char in PRINTABLE:
                if len(vocab) >= vocab_size - 1:
                    break
                merges.append((stem, char))
                vocab[stem + char] = len(vocab)
                longer.append(stem + char)
        stems = longer
    vocab["<|endoftext|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def save_hf_model(out_dir: Path, seed: int = 0, config_overrides: dict | None = None) -> Path:
    """The project's seeded random GPT-2 (servingplan.profile.model) saved with its tokenizer."""
    from servingplan.profile.model import RANDOM_SOURCE, load_model

    out_dir = Path(out_dir)
    model, _ = load_model(RANDOM_SOURCE, seed, config_overrides)
    model.save_pretrained(out_dir)
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text())
    config.setdefault("n_ctx", config["n_positions"])
    config_file.write_text(json.dumps(config, indent=2))
    synthetic_tokenizer(model.config.vocab_size).save_pretrained(out_dir)
    return out_dir


def convert(hf_dir: Path, out_file: Path, llama_dir: Path | None = None, outtype: str = "f32") -> Path:
    """Run the pinned convert_hf_to_gguf.py on `hf_dir` (in a subprocess) into `out_file`."""
    llama_dir = Path(llama_dir or build.source_dir())
    if not (llama_dir / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(f"{llama_dir}: no convert_hf_to_gguf.py (run `make llamacpp` first)")
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("NO_LOCAL_GGUF", None)
    subprocess.run([sys.executable, "-m", "servingplan.llamacpp.gguf_model", "_convert", str(llama_dir),
                    str(hf_dir), "--outfile", str(out_file), "--outtype", outtype],
                   check=True, env=env)
    return out_file


def _run_converter(llama_dir: str, argv: list[str]) -> None:
    sys.path.insert(0, llama_dir)
    import convert_hf_to_gguf  # noqa: E402  (the pinned sdist's script, which puts its gguf-py on sys.path)
    from conversion import base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"   # the synthetic tokenizer
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()


def make_gguf(out_file: Path, seed: int = 0, tiny: bool = False, work_dir: Path | None = None) -> Path:
    import tempfile
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        hf = save_hf_model(Path(tmp) / "hf", seed, TINY_OVERRIDES if tiny else None)
        return convert(hf, out_file)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_convert":
        _run_converter(argv[1], argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="the 2-layer test model instead of GPT-2 small")
    args = p.parse_args(argv)
    print(make_gguf(args.out, args.seed, args.tiny))


if __name__ == "__main__":
    main()
