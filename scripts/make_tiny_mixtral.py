"""Write a tiny random Mixtral checkpoint folder, offline: to try `--model` without a download.

A Hugging Face checkpoint folder as `--model` takes one (config.json, the weights in
safetensors, tokenizer.json and a tokenizer_config.json with a chat template), with random
weights and the shapes of configs/tiny-chat.yaml's model, and examples/chat-tokenizer as its
tokenizer. transformers loads it as it loads any Mixtral:

    python scripts/make_tiny_mixtral.py tiny-mixtral     # writes the folder tiny-mixtral/
    python run_finetune_ep.py --model tiny-mixtral --format chat --dataset examples/chat.jsonl

It learns nothing useful: it stands in for a real checkpoint where the point is the
command, not the model (the README's commands are tested on it).
"""

import argparse
import filecmp
import shutil
import tempfile
from pathlib import Path

import tokenizers
import torch
from transformers import MixtralConfig, MixtralForCausalLM

TOKENIZER = Path(__file__).resolve().parents[1] / "examples" / "chat-tokenizer"


def write_tiny_mixtral(out: Path, seed: int = 0) -> None:
    """Write the checkpoint folder `out` (created; refused if it holds anything but this very
    checkpoint, which is left as it is: the README's blocks each make it, and a reader runs
    them one after another in one folder)."""
    if out.exists() and any(out.iterdir()):
        with tempfile.TemporaryDirectory() as made:
            _write(Path(made), seed)
            if not _same_files(Path(made), out):
                raise SystemExit(f"{out} is not empty: name a new folder")
        print(f"{out} holds this tiny checkpoint already: left as it is")
        return
    _write(out, seed)


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and filecmp.cmpfiles(a, b, names, shallow=False)[0] == names


def _write(out: Path, seed: int) -> None:
    tokenizer = tokenizers.Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    config = MixtralConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
                           bos_token_id=tokenizer.token_to_id("<s>"), eos_token_id=tokenizer.token_to_id("</s>"),
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    MixtralForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write (new or empty)")
    write_tiny_mixtral(parser.parse_args().out)


if __name__ == "__main__":
    main()
