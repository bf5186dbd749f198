"""A LoRA fine-tune of a Hugging Face checkpoint through the command line, as a user runs it:
the run names what it wrote, PEFT loads the adapters it exported (dropout on expert targets
included) with the run's tokenizer beside them, and the frozen base never reaches the optimizer
or a checkpoint."""

import json

import peft
import pytest
import torch
from conftest import REPO
from hf_reference import random_hf_mixtral
from launch import assert_one_line_error, run_cli
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import MixtralForCausalLM

from te_mixtral.config import load_config
from te_mixtral.distributed.layout import Layout
from te_mixtral.model.lora import is_adapter_param
from te_mixtral.training.loop import build_model
from te_mixtral.training.optimizer import make_optimizer

TINY = dict(vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
LORA = ["--lora.rank", "2", "--lora.dropout", "0.1", "--lora.targets", "q_proj,v_proj,gate_up_proj,down_proj"]
STEPS = ["--steps", "2", "--timing_warmup_steps", "0", "--batch_size", "2", "--seq_len", "64",
         "--tokenizer_vocab_size", "300", "--max_documents", "50"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """One LoRA run of a random HF checkpoint: a checkpoint after each step, the adapters
    and the merged model exported."""
    root = tmp_path_factory.mktemp("lora_run")
    torch.manual_seed(0)
    random_hf_mixtral(**TINY).save_pretrained(root / "base")
    proc = run_cli(["--model", str(root / "base"), *STEPS, *LORA, "--output-dir", str(root / "run"),
                    "--checkpoint-dir", str(root / "ckpt"), "--checkpoint_every", "1",
                    "--save-hf", str(root / "merged"), "--save-adapter", str(root / "adapter")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, proc


def test_the_run_ends_naming_what_it_wrote(lora_run, tmp_path):
    root, proc = lora_run
    tail = proc.stdout.splitlines()[-4:]
    assert tail == [f"results: {root / 'run' / 'results.json'}", f"checkpoint: {root / 'ckpt' / 'step-000002'}",
                    f"HF export: {root / 'merged'}", f"adapter: {root / 'adapter'}"], proc.stdout[-2000:]
    # Only what was written: a run that saves nothing names nothing but its results.
    proc = run_cli([*STEPS, "--model.num_hidden_layers", "1", "--output-dir", str(tmp_path / "plain")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == f"results: {tmp_path / 'plain' / 'results.json'}"


def test_peft_loads_adapters_trained_with_dropout_on_expert_targets(lora_run):
    """PEFT refuses dropout on a parameter target: the export must leave it out (dropout acts
    only in training, so the adapters are the same without it) and still load, exactly."""
    root, _ = lora_run
    saved = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert saved["target_parameters"] and saved["lora_dropout"] == 0.0
    base = MixtralForCausalLM.from_pretrained(root / "base").eval()
    merged = MixtralForCausalLM.from_pretrained(root / "merged").eval()
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before, want = base(input_ids=ids).logits, merged(input_ids=ids).logits
        got = peft.PeftModel.from_pretrained(base, root / "adapter").eval()(input_ids=ids).logits  # adapts `base`
    assert (want - before).abs().max() > 1e-4  # the adapters trained
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_adapter_carries_the_runs_tokenizer(lora_run):
    """The adapters learnt the run's token ids and chat template, which need not be the base's
    (here the run trained its own; --tokenizer names another): the adapter folder holds them, as
    the merged export does, for AutoTokenizer and AutoPeftModelForCausalLM to read there."""
    root, _ = lora_run
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (root / "adapter" / name).read_bytes() == (root / "merged" / name).read_bytes(), name
    assert not (root / "base" / "tokenizer.json").exists()  # the base's users could not have it from there


def test_the_frozen_base_never_reaches_the_optimizer(lora_run):
    root, _ = lora_run
    # No checkpoint holds optimizer state, or a weight, of the base: adapters only, each with
    # both AdamW moments.
    checkpoints = sorted((root / "ckpt").glob("step-*"))
    assert len(checkpoints) == 2
    for folder in checkpoints:
        keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        names = {key.split(".", 1)[1].rsplit(".", 1)[0] for key in keys if key.startswith("optimizer.")}
        weights = {key.split(".", 1)[1] for key in keys if key.startswith("model.")}
        assert names == weights and weights and all(is_adapter_param(n) for n in weights), sorted(keys)
        assert {key for key in keys if key.startswith("optimizer.")} == {
            f"optimizer.{n}.{m}" for n in names for m in ("exp_avg", "exp_avg_sq", "step")}

    # Nor is the base in the optimizer's groups, where AdamW (which skips a parameter without
    # a gradient) would hold it without a word.
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), {"lora.rank": "2"})
    model, _ = build_model(cfg, Layout(0, 1, 1, None, None), torch.device("cpu"))
    grouped = [p for group in make_optimizer(model, cfg).param_groups for p in group["params"]]
    adapters = [p for name, p in model.named_parameters() if is_adapter_param(name)]
    assert len(grouped) == len(adapters) > 0 and {id(p) for p in grouped} == {id(p) for p in adapters}


def files_of(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_finished_run_resumed_with_an_export_asked_for_exports_its_weights(lora_run, tmp_path):
    """A run whose export failed (a full disk) or was not asked for has its trained weights in
    its last checkpoint only: resumed with an export asked for, it trains no step and writes
    the exports the run would have written, byte for byte. Without one, nothing is left to do."""
    root, _ = lora_run
    resumed = ["--model", str(root / "base"), *STEPS, *LORA, "--checkpoint-dir", str(root / "ckpt"), "--resume"]
    proc = run_cli([*resumed, "--output-dir", str(tmp_path / "run"), "--save-hf", str(tmp_path / "merged"),
                    "--save-adapter", str(tmp_path / "adapter")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step    1/2" not in proc.stdout and "step    2/2" not in proc.stdout  # trained no step
    assert files_of(tmp_path / "merged") == files_of(root / "merged")
    assert files_of(tmp_path / "adapter") == files_of(root / "adapter")
    assert (root / "ckpt" / "latest").read_text() == "step-000002\n"  # no checkpoint written
    assert sorted(p.name for p in (root / "ckpt").glob("step-*")) == ["step-000001", "step-000002"]
    proc = run_cli([*resumed, "--output-dir", str(tmp_path / "again")])
    assert proc.returncode != 0 and "nothing left to do" in proc.stderr


def test_a_resume_reads_its_checkpoints_adapters_not_lora_init_and_says_so(lora_run, tmp_path):
    """The checkpoint holds the adapters as they trained since the run started from lora.init,
    and their optimizer state: the same command with --resume goes on from it (lora.init's
    settings, which the checkpoint's are, still taken), with a line that the adapter is not read."""
    root, _ = lora_run
    changed = tmp_path / "adapter"  # another adapter of the same settings: were it read, the export would show it
    changed.mkdir()
    (changed / "adapter_config.json").write_bytes((root / "adapter" / "adapter_config.json").read_bytes())
    tensors = load_file(root / "adapter" / "adapter_model.safetensors")
    save_file({key: t + 1 for key, t in tensors.items()}, changed / "adapter_model.safetensors")
    proc = run_cli(["--model", str(root / "base"), *STEPS, "--lora.dropout", "0.1", "--lora.init", str(changed),
                    "--checkpoint-dir", str(root / "ckpt"), "--resume", "--output-dir", str(tmp_path / "run"),
                    "--save-adapter", str(tmp_path / "exported")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"te_mixtral: note: lora.init {changed} is not read: the checkpoint holds the adapters as they trained "
            f"since") in proc.stdout
    assert load_file(tmp_path / "exported" / "adapter_model.safetensors").keys() == tensors.keys()
    assert all(torch.equal(t, tensors[key]) for key, t in load_file(tmp_path / "exported" /
                                                                   "adapter_model.safetensors").items())


def test_a_resume_over_a_base_whose_weights_changed_is_refused(tmp_path):
    """The checkpoint holds the adapters alone; the base comes back from --model. A folder of
    the same name holding other weights of the same shapes (made again, or another model put
    there) is another base, refused; the same weights laid out in other files are not."""
    torch.manual_seed(0)
    base = random_hf_mixtral(**TINY)
    base.save_pretrained(tmp_path / "base")

    def run(steps, *more):
        return run_cli(["--model", str(tmp_path / "base"), *STEPS, *LORA, "--steps", str(steps), "--checkpoint-dir",
                        str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / f"run{steps}"), *more])

    proc = run(1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    base.save_pretrained(tmp_path / "base", max_shard_size="20KB")  # the same weights, in other files
    assert len(list((tmp_path / "base").glob("*.safetensors"))) > 1
    proc = run(2, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.manual_seed(1)
    random_hf_mixtral(**TINY).save_pretrained(tmp_path / "base")  # another base, of the same shapes
    proc = run(3, "--resume")
    assert_one_line_error(proc, f"checkpoint {tmp_path / 'ckpt' / 'step-000002'} holds LoRA adapters trained over "
                          f"the base model {tmp_path / 'base'} as it was then, whose weights have changed since")
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-000002\n"
