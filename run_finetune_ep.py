r"""Fine-tune a Mixtral-style MoE model with expert parallelism.

    python run_finetune_ep.py                      # tiny model, embedded data, CPU or GPU
    torchrun --nproc_per_node=2 run_finetune_ep.py --config configs/tiny.yaml --tier loop --ep-size 2
    python run_finetune_ep.py --config configs/mixtral-8x7b-2layer.yaml --tier grouped_linear --steps 20

Any config key can be overridden: `--lr 1e-4`, `--train.steps 10`, `--model.num_hidden_layers 4`.

Fine-tune a Hugging Face checkpoint, evaluate, export, and survive a crash (docs/checkpoints.md):

    torchrun --nproc_per_node=2 run_finetune_ep.py --ep-size 2 --model PATH_OR_HUB_ID \
        --eval-fraction 0.05 --eval-every 10 --checkpoint-dir ckpt --checkpoint-every 10 \
        --save-hf finetuned --generate "The meaning of"
    ... the same command with --resume continues from the latest checkpoint in ckpt.

--model's config.json replaces the config's `model` section; its tokenizer.json is used
when data.tokenizer is unset.
"""

import sys

from te_mixtral.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
