"""HF checkpoints out, end to end: fine-tune an HF checkpoint with EP=2 (`--model`), evaluate
on held-out data, export (`--save-hf`), generate; then check every result against
transformers running the exported checkpoint."""

import json
import re
import shutil

import pytest
import torch
from conftest import REPO
from launch import RUN_DIR, WORKER, run_cli, run_worker
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    MixtralForCausalLM,
)

from te_mixtral.config import DataConfig
from te_mixtral.data.packing import PackedData
from te_mixtral.model.mixtral import causal_lm_loss

SEQ_LEN, BATCH, STEPS, SEED = 64, 4, 4, 1234
PROMPT = "The meaning of"


def hf_loss(model, batches) -> float:
    """The training loss normalisation over several batches: summed token loss / targets."""
    summed, targets = 0.0, 0
    with torch.no_grad():
        for b in batches:
            # Without a cache, position ids that restart at 0 make transformers mask each document.
            logits = model(input_ids=b.input_ids, position_ids=b.packed.position_ids_BS, use_cache=False).logits
            summed += causal_lm_loss(logits, b.labels, torch.ones(())).item()
            targets += int((b.labels != -100).sum())
    return summed / targets


SCRIPT = "tests/workers/train_then_logits.py"
# A tiny random HF Mixtral with the default data's tokenizer.json (written by the worker's rank
# 0), fine-tuned by the app with EP=2, evaluated, exported and generating.
SOURCE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024, bos_token_id=None,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
ARGS = [f"{RUN_DIR}/ours.pt", "--random-model", json.dumps(SOURCE), "--model", f"{RUN_DIR}/source", "--ep-size", "2",
        "--steps", str(STEPS), "--timing_warmup_steps", "1", "--batch_size", str(BATCH), "--seq_len", str(SEQ_LEN),
        "--log_every", "1", "--eval-fraction", "0.05", "--eval-every", "2", "--save-hf", f"{RUN_DIR}/run/hf",
        "--save-every", "2", "--generate", PROMPT, "--generate-tokens", "8", "--output-dir", f"{RUN_DIR}/run"]
PLANNED_RUNS = {2: [[WORKER, SCRIPT, *ARGS]]}  # run in the session's two-rank launch (conftest.py's launch_planned)


@pytest.fixture(scope="module")
def run(tmp_path_factory, launch_planned):
    """The source checkpoint, the export, results.json, our logits, the data, the ranks' stdout."""
    root = tmp_path_factory.mktemp("hf_out")
    launch_planned(2)
    proc = run_worker(root, SCRIPT, ARGS, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    source, out = root / "source", root / "run"
    results = json.loads((out / "results.json").read_text())
    data = PackedData(DataConfig(tokenizer=str(source), seq_len=SEQ_LEN, eval_fraction=0.05), BATCH, 0, 1, SEED)
    return source, out / "hf", results, torch.load(root / "ours.pt"), data, proc.stdout


def test_training_starts_from_the_checkpoint(run):
    source, _, results, _, data, stdout = run
    # The folder the planned run read (its own, which was copied here).
    assert re.search(r"weights and model config from \S+/source \(", stdout), stdout[-2000:]
    hf = MixtralForCausalLM.from_pretrained(source, dtype=torch.float32)
    assert abs(results["losses"][0] - hf_loss(hf, data.micro_batches(0))) < 1e-5 * results["losses"][0]


def test_export_loads_in_transformers_with_our_logits(run):
    _, exported, _, ours, _, _ = run
    assert not list(exported.parent.glob("*.tmp")), "a temporary export folder was left behind"
    hf = AutoModelForCausalLM.from_pretrained(exported)
    assert hf.dtype == torch.float32
    with torch.no_grad():
        logits = hf(input_ids=ours["ids"], position_ids=torch.arange(16).expand(2, 16)).logits
    torch.testing.assert_close(logits, ours["logits"], rtol=1e-4, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.eos_token == "<eos>" and tokenizer(PROMPT).input_ids


def test_generation_matches_transformers_greedy(run):
    _, exported, results, _, _, stdout = run
    generated = results["generate"]
    assert f"generate: {PROMPT!r} -> " in stdout and len(generated["tokens"]) > 0
    hf = AutoModelForCausalLM.from_pretrained(exported)
    eos = hf.config.eos_token_id
    out = hf.generate(torch.tensor([generated["prompt_ids"]]), max_new_tokens=8, do_sample=False,
                      eos_token_id=eos, pad_token_id=eos)
    assert out[0, len(generated["prompt_ids"]):].tolist() == generated["tokens"]


def test_eval_loss_is_the_held_out_loss_of_the_final_model(run):
    _, exported, results, _, data, _ = run
    assert [e["step"] for e in results["evals"]] == [2, 4]
    final = results["evals"][-1]
    assert final["targets"] == sum(int((b.labels != -100).sum()) for b in data.eval_batches())
    hf = AutoModelForCausalLM.from_pretrained(exported)
    assert abs(final["loss"] - hf_loss(hf, data.eval_batches())) < 1e-5 * final["loss"]
    assert abs(final["perplexity"] - torch.tensor(final["loss"]).exp().item()) < 1e-3 * final["perplexity"]


TOOL_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
ADDED = ["<tool_call>", "<|x|>"]  # tokens that only added_tokens.json names, not tokenizer.json


def tokenizer_folder(folder):
    """A tokenizer folder as transformers v5 and older saves leave them: tokenizer.json, the
    default chat template in chat_template.jinja alone (no tokenizer_config.json to name it),
    a named one in additional_chat_templates/, and an added_tokens.json of tokens tokenizer.json
    lacks (older transformers wrote one)."""
    folder.mkdir()
    source = REPO / "examples" / "chat-tokenizer"
    shutil.copyfile(source / "tokenizer.json", folder / "tokenizer.json")
    template = json.loads((source / "tokenizer_config.json").read_text())["chat_template"]
    (folder / "chat_template.jinja").write_text(template.replace("eos_token", "'</s>'"))
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_TEMPLATE)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    (folder / "added_tokens.json").write_text(json.dumps({token: vocab + i for i, token in enumerate(ADDED)}))
    return folder


def test_a_chat_export_keeps_the_tokenizer_and_chat_templates_it_was_trained_with(tmp_path):
    """A chat run reads its tokenizer folder with AutoTokenizer: the default template from
    chat_template.jinja, the named ones from additional_chat_templates/, the tokens of
    added_tokens.json. The export must load as the same tokenizer, or the fine-tune is served
    with another template, none, or other token ids."""
    tokenizer = tokenizer_folder(tmp_path / "tokenizer")
    proc = run_cli(["--config", "configs/tiny-chat.yaml", "--tokenizer", str(tokenizer), "--vocab_size", "1056",
                    "--steps", "1", "--timing_warmup_steps", "0", "--output-dir", str(tmp_path / "run"), "--save-hf",
                    str(tmp_path / "hf")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    source, export = (AutoTokenizer.from_pretrained(folder) for folder in (tokenizer, tmp_path / "hf"))
    assert set(source.chat_template) == {"default", "tool_use"}  # the folder reads as meant
    assert export.chat_template == source.chat_template
    messages = [{"role": "user", "content": "Hi <tool_call>"}, {"role": "assistant", "content": "Hello<|x|>"}]
    for template in ("default", "tool_use"):
        for tokenize in (False, True):
            want, got = (t.apply_chat_template(messages, chat_template=template, tokenize=tokenize)
                         for t in (source, export))
            assert got == want, (template, tokenize)
    text = "a <tool_call> b<|x|>"
    assert export(text).input_ids == source(text).input_ids and len(source(text).input_ids) < len(text) // 2
    assert export.added_tokens_decoder == source.added_tokens_decoder


def test_a_text_export_tokenizes_as_the_run_did(tmp_path):
    """A text run reads the folder's tokenizer.json alone (data/tokenizer.py), so added_tokens.json's
    tokens were never trained: the export must not bring them back (outputs.py refuses such a file
    beside an export), while it keeps the folder's chat templates as a chat run's export does."""
    import tokenizers

    tokenizer = tokenizer_folder(tmp_path / "tokenizer")
    proc = run_cli(["--tokenizer", str(tokenizer), "--steps", "1", "--timing_warmup_steps", "0", "--seq_len", "32",
                    "--output-dir", str(tmp_path / "run"), "--save-hf", str(tmp_path / "hf")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    trained = tokenizers.Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    export = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "a <tool_call> b<|x|>"
    assert export(text).input_ids == trained.encode(text).ids
    assert set(export.chat_template) == {"default", "tool_use"}
